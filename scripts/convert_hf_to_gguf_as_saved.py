#!/usr/bin/env python
"""Run llama.cpp's convert_hf_to_gguf.py with the directory's tokenizer read as it is saved.

  python scripts/convert_hf_to_gguf_as_saved.py PATH/TO/llama.cpp/convert_hf_to_gguf.py HF_DIR \
      --outfile OUT.gguf --outtype bf16 [--no-mtp]

(llama.cpp's folder and its gguf-py on PYTHONPATH.) The converter reads the tokenizer through
transformers' AutoTokenizer, which for a Qwen3.5-MoE config builds Qwen's tokenizer class over
whatever tokenizer.json the directory holds, re-deriving its pre-tokenizer; the converter then
refuses the pre-tokenizer's hash. The random-weight models of scripts/make_scale_model.py and the
tests carry SmolLM2's tokenizer (their token ids are valid prompts): here AutoTokenizer reads the
saved tokenizer.json unchanged, and the converter runs as it is otherwise (the weights and their
transforms are the converter's own).
"""
import runpy
import sys

import transformers

transformers.AutoTokenizer.from_pretrained = transformers.PreTrainedTokenizerFast.from_pretrained
sys.argv = sys.argv[1:]
if not sys.argv:
    sys.exit(__doc__)
runpy.run_path(sys.argv[0], run_name="__main__")

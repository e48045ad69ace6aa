"""`jaxbatch generate`: one-shot generation (chat template applied unless --raw)."""

from __future__ import annotations

import argparse

from jaxbatch.cli.engine_args import add_engine_args, engine_config_from_args, fetch_model


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxbatch generate")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_args(p)
    args = p.parse_args(argv)
    from jaxbatch import LLM, SamplingParams

    config = engine_config_from_args(args)
    fetch_model(config, "jaxbatch generate")
    llm = LLM(config=config)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.raw:
        outs = llm.generate(args.prompt, sp, use_tqdm=False)
    else:
        outs = llm.chat([[{"role": "user", "content": t}] for t in args.prompt], sp,
                        use_tqdm=False)
    for prompt, o in zip(args.prompt, outs):
        print(f"### {prompt}\n{o.outputs[0].text}\n")
    return 0

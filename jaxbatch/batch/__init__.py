"""Offline batch jobs in the OpenAI Batch format (`jaxbatch batch`, whose command line is
jaxbatch/cli/batch.py): files.py (input pre-pass, output recovery, result writer), records.py
(a line -> a parsed request -> an output record, through jaxbatch.api.protocol exactly as the
server parses and answers), job.py (the loop over one engine)."""

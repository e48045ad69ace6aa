"""Offline batch jobs in the OpenAI Batch format (`jaxbatch batch`, entry point
jaxbatch.cli.batch:main): files.py (input pre-pass, output recovery, writer), records.py (a line
-> an engine request -> an output record, through jaxbatch.openai_protocol), job.py (the loop)."""

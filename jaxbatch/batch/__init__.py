"""Offline batch jobs in the OpenAI Batch format (`jaxbatch batch`, entry point
jaxbatch.batch_job:main): files.py (input pre-pass, output recovery, writer), records.py (a line
-> an engine request -> an output record, through jaxbatch.server.protocol), job.py (the loop)."""

"""The fused engine: ``fused=True``, one pass over memory per (device, dtype) bucket.

A rule's reference loop is compiled by Inductor (``kernel``), applied chunk by chunk as a kept
``plan`` says, and on CUDA replayed as CUDA graphs (``graphs``); ``run`` is the entry point.
"""

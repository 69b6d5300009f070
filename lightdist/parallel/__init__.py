"""The parallel dimensions: how a model is split (tensor, pipeline, context, expert, ZeRO/FSDP sharding,
activation checkpointing, loss parallelism) and the probes of its structure and layouts that tell how.
"""

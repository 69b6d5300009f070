"""Data: corpora tokenized once into token shards, streamed by ranges, and mixed."""

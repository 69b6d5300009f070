"""Planning: memory and throughput of a layout before launch, and the timeline of a traced pipeline."""

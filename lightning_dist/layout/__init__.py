"""The *layout* part's torch-side pieces: the sharded device mesh and which modules FSDP2 shards."""

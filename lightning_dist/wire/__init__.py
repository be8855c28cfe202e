"""The *wire* part: a compressor or the pack's transport on whatever collective a layout uses (DDP
communication hooks, FSDP2's custom all-gather/reduce-scatter, FaultTolerant's gradient sum)."""

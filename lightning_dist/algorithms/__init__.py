"""Pure maths of the strategies (no transport, no Lightning): DiLoCo's outer step, learning-rate
scaling, micro-batch slots, state moved to the CPU."""

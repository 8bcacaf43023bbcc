"""What every layer runs on: user errors, the device mesh and sharding rules, host memory, timing."""

"""`pdserve chaos`: fault injection against a real local cluster (see serve.chaos.runner)."""

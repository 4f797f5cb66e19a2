"""What runs in a training process on every rank: the worker, the loop, the backends, the model build,
precision, optimizer, tracking, the memory plan and the FLOPs count."""

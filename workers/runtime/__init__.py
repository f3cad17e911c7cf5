"""The worker process around its engine: the socket loop, the broker link, configuration, devices, the
role adapters and tensor/pipeline parallelism."""

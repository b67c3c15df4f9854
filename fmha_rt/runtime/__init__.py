"""The runtime under the planner: the GPU driver backend, code objects and their registry, argument
packing, kernel launches and the executor that runs a plan, device buffers, streams and DLPack."""

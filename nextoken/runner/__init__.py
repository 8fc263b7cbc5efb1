"""Running the model: one forward pass over a batch, and the plan binding the kernels.

Also threads, the quick start (`nextoken run`'s first token), the tensor-parallel follower."""

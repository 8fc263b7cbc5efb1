"""Tensor parallelism on `torch.distributed`, Megatron-LM's split as vLLM applies it.

(Shoeybi et al. 2019, arXiv:1909.08053.)

    rank 0: scheduler, sampler, HTTP   ranks 1..N-1: `runner.follower` -> `ModelRunner.follow`
      step -> runner.execute(seqs) ----broadcast(seqs)----> runner.execute(seqs)
              each rank: 1/N of every layer's heads and feed-forward columns, 1/N of the
              vocabulary, 1/N of the KV cache
              attention out, MLP out: all-reduce (sum of the ranks' partial products)
              embedding: all-reduce (each rank looks up the ids of its vocabulary slice)
              LM head: all-gather of the vocabulary slices -> full logits on every rank

- `group`: the process group (gloo on CPU), its collectives with their counts and times, the
  step broadcast, and how the ranks start (``torchrun``, or spawned by rank 0);
- `sharding`: which rows or columns of each weight a rank holds (the architecture's
  ``TP_PLAN``), and the per-rank model configuration.
"""

"""Embeddings, scores and reranking (pooling models): request bodies and answers (`protocol`),
the embedding model serving many requests (`serving`), and the routes (`router`): OpenAI's
``/v1/embeddings``, vLLM's ``/v1/score`` and ``/v1/rerank`` (cosine similarity of the model's
vectors, no cross-encoder), ``/tokenize`` on an embedding-only server."""

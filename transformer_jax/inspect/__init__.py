"""Looking inside a trained Transformer, and the paper's explanations tested as experiments.

    python -m transformer_jax.inspect --workdir DIR --sentence "The old dog saw a red car." [--out OUT]

One module per experiment; ``report.run`` runs them all and writes one folder (``index.html`` links
everything; ``summary.md`` is printed):

- ``forward``: restore a workdir; the teacher-forced forward that collects every attention's sown
  weights, queries and keys; which keys each real query may attend to; greedy decoding of one sentence.
- ``maps``: the attention maps of one sentence (``maps/``: a PNG per kind, layer and head, the numbers
  in ``attention_maps.npz`` and ``manifest.json``).
- ``heads``: head statistics over dev sentences, padding excluded: entropy, max weight, the share of mass
  on the previous / same / next position (``head_stats.*``).
- ``dev``: one pass over the dev batches feeding ``heads`` and the model half of ``scaling``.
- ``scaling`` (section 3.2.1): attention entropy with and without 1/sqrt(d_k), on random unit-variance
  q, k as d_k grows and on the model's own q, k (``scaling*``).
- ``positions``: the mechanism of the model's position scheme (``positions*``). The sinusoid (section
  3.5): PE(pos+k) = M_k PE(pos) for one block-diagonal rotation M_k per offset k, and the cosine
  similarity of positions; learned tables: the same fit on the model's own tables; rotary: each dimension
  pair's rate and wavelength, and the logit of a fixed query/key pair by offset; ALiBi: the head slopes and
  the bias by offset; relative: the norms of each layer's a^K and a^V rows by distance and their cosine
  across distances; without positions the section says it does not apply.
- ``complexity`` (Table 1 measured): XLA's FLOPs and the wall time of one self-attention layer against
  n, beside n^2 d and n d^2, dense and blockwise (``complexity.*``).
- ``ablation``: every head ablated in turn (its rows of W^O zeroed) and the change in dev loss, because an
  attention weight is a mixing coefficient, not an explanation (``ablation.*``).
- ``alignment`` (synthetic task only): each cross-attention head's mass on the source word that the
  grammar aligns with the target word being produced, also for reordered words (``alignment.*``).
- ``artifacts`` (figures and tables), ``page`` (the HTML page), ``report`` (running everything, the
  summary), ``__main__`` (the command line).

Conventions. Attention kinds are ``encoder_self``, ``decoder_self`` and ``cross``. Weights are
``float32[batch, heads, q_len, kv_len]`` (as the model sows them). Decoder position t reads the decoder
input token (BOS, y_1, ..., y_t) and predicts y_{t+1}; plots label decoder queries with the token they
predict and decoder self-attention keys with the input token at that position. Masks are boolean,
True = may attend, as everywhere in this package.

Every import in this package is absolute, so the package's name hides nothing: ``import inspect``
still means the standard library's. Run the command line with ``python -m``.
"""

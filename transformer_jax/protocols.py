"""Names that the config layer validates and evaluation implements, kept below both.

``run_config`` checks ``dev_bleu_protocol`` against ``BLEU_PROTOCOLS`` and ``evaluation.bleu`` computes
each of them, so the config layer imports no evaluation module.
"""

# The BLEU protocols, in the order reports print them: sacreBLEU (13a, cased), the paper's tokenized
# compound-split BLEU, and the Multi30k literature's lowercased, Moses-tokenized BLEU.
BLEU_PROTOCOLS = ("sacrebleu", "tokenized", "multi30k")

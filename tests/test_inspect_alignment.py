"""The synthetic grammar's word alignment (data/synthetic.py) and inspect/alignment.py's use of it."""

from transformer_jax.data import synthetic
from transformer_jax.inspect import alignment


def _big_dog_sleeps(lex):
    suffix = synthetic.AGREEMENT["nom"]["sg"][lex.noun_gender["dog"]]
    return (f"{lex.stem['the'] + suffix} {lex.noun_stem['dog']} {lex.stem['big'] + suffix} "
            f"{lex.stem['sleep'] + synthetic.VERB_SUFFIX['pres']['3s']}.").capitalize()


def test_word_alignment_follows_the_grammar():
    lex = synthetic.build_lexicon(0)
    pairs = synthetic.word_alignment("The big dog sleeps.", _big_dog_sleeps(lex), 0)
    assert pairs == [(0, 0), (1, 2), (2, 1), (3, 3)]  # the adjective follows its noun
    assert alignment.reordered_words(pairs) == {2}
    # A second 'the' makes both ambiguous; a copied name aligns with itself.
    suffix = synthetic.AGREEMENT["nom"]["sg"][lex.noun_gender["dog"]]
    target = f"{lex.stem['the'] + suffix} {lex.noun_stem['dog']} {lex.stem['the'] + suffix} Anna."
    assert synthetic.word_alignment("The dog the Anna.", target, 0) == [(1, 1), (3, 3)]
    other_language = synthetic.word_alignment("The big dog sleeps.", _big_dog_sleeps(lex), 1)
    assert other_language != pairs


def test_word_alignment_on_generated_pairs():
    pairs = synthetic.SyntheticSource(train_size=0, dev_size=97, test_size=0, seed=0).pairs("dev")
    aligned = total = reordered = 0
    for source, target in pairs:
        links = synthetic.word_alignment(source, target, 0)
        targets = [t for t, _ in links]
        assert targets == sorted(set(targets))  # one link per target word, in order
        assert all(0 <= s < len(source.split()) and 0 <= t < len(target.split()) for t, s in links)
        assert len({s for _, s in links}) == len(links)  # a source word's lemma is unique when linked
        aligned, total = aligned + len(links), total + len(target.split())
        reordered += len(alignment.reordered_words(links))
    assert aligned > 0.75 * total  # most target words inflect exactly one source word's lemma
    assert reordered > 0.05 * aligned  # adjectives and verb-final clauses reorder


def test_word_of_piece_and_reordered_words():
    assert alignment.word_of_piece(["\u2581Th", "e", "\u2581big", ".", "</s>"]) == [0, 0, 1, 1, -1]
    assert alignment.word_of_piece(["x", "\u2581y", "<pad>"]) == [0, 1, -1]  # a first piece opens a word
    assert alignment.reordered_words([(0, 0), (1, 3), (2, 1), (3, 2), (4, 4)]) == {2, 3}
    assert alignment.reordered_words([(0, 0), (1, 1)]) == set()

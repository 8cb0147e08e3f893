"""The tokenizer and sampler stand-ins are deterministic and depend on what they should."""

from __future__ import annotations

from kvxferd.sim.tokens import BOS, VOCAB_SIZE, chat_prompt, generate, prompt_seed, tokenize


def test_tokenize_is_deterministic_starts_with_bos_and_stays_in_the_vocabulary():
    ids = tokenize("Hello, world! abcdefghijklmnopqr")
    assert ids == tokenize("Hello, world! abcdefghijklmnopqr")
    assert ids[0] == BOS
    # Hello , world ! + the long word cut into 6-character pieces (18 chars -> 3 pieces)
    assert len(ids) == 1 + 4 + 3
    assert all(0 <= t < VOCAB_SIZE for t in ids)
    assert tokenize("Hello world") != tokenize("hello world")


def test_empty_prompt_is_one_token():
    assert tokenize("") == [BOS]


def test_chat_prompt_tags_each_turn_and_ends_with_the_reply_tag():
    text = chat_prompt([("system", "be brief"), ("user", "hi")])
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def test_prompt_seed_depends_on_every_token():
    assert prompt_seed([1, 2, 3]) == prompt_seed([1, 2, 3])
    assert prompt_seed([1, 2, 3]) != prompt_seed([1, 2, 4])
    assert prompt_seed([1, 2, 3]) != prompt_seed([1, 2, 3, 0])
    assert 0 <= prompt_seed([5]) < 2**63


def test_generate_is_a_function_of_the_digest():
    assert generate(42, 8) == generate(42, 8)
    assert generate(42, 8) != generate(43, 8)
    assert generate(42, 3) == generate(42, 8)[:3]
    assert all(t.startswith(" ") and len(t) > 1 for t in generate(7, 20))


def test_a_lone_surrogate_is_a_piece_of_its_own():
    # JSON may escape one ("\ud800"); UTF-8 has no bytes for it, yet vLLM serves such a prompt.
    ids = tokenize("half \ud800 of a pair\udc00")
    assert ids == tokenize("half \ud800 of a pair\udc00")
    assert len(ids) == 1 + 6 and all(0 <= t < VOCAB_SIZE for t in ids)
    others = [
        "half \udc00 of a pair\udc00",
        "half ? of a pair\udc00",
        "half \ufffd of a pair\udc00",
    ]
    assert all(tokenize(other) != ids for other in others)

"""The decoder reranker: exact KV reuse, batching, padding, defined edge cases."""

from __future__ import annotations

import math

import pytest

from kvrag_integrations.rerank import (
    BGE_GEMMA_TEMPLATE,
    DEFAULT_TEMPLATE,
    TEMPLATES,
    KVReranker,
    RerankTemplate,
)
from kvrag_integrations.store import MemoryKVStore

QUERY = "What is the capital of Australia?"
ANSWER = "Canberra is the capital city of Australia. It was founded in 1913."
DOCS = [
    "Pasta is a staple food of Italian cuisine, made from wheat flour and water.",
    "The Great Barrier Reef is the world's largest coral reef system.",
    ANSWER,
    "Mount Everest is the highest mountain above sea level, in the Himalayas.",
    "Sydney is the largest city in Australia and is famous for its opera house.",
    "The violin is a wooden string instrument in the violin family.",
]
ATOL = 1e-3


def make(engine, **kwargs) -> KVReranker:
    """A reranker on a store of its own; the yes/no judge unless ``scoring`` is given
    (most tests here are about its prompt layout)."""
    kwargs.setdefault("store", MemoryKVStore())
    if "template" not in kwargs:
        kwargs.setdefault("scoring", "judge")
    return KVReranker(engine, **kwargs)


def assert_close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, abs=ATOL)


def test_reuse_matches_full_forward(engine):
    reranker = make(engine, batch_size=8)
    cached = reranker.score(QUERY, DOCS)
    assert reranker.stats.prefixes_encoded == len(DOCS)
    assert_close(cached, reranker.score(QUERY, DOCS, reuse=False))


def test_batched_matches_one_by_one(engine):
    batched = make(engine, batch_size=8)
    single = make(engine, batch_size=1)
    for reuse in (True, False):
        one_by_one = single.score(QUERY, DOCS, reuse=reuse)
        assert_close(batched.score(QUERY, DOCS, reuse=reuse), one_by_one)


def test_padding_never_changes_a_score(engine):
    reranker = make(engine, batch_size=8)
    long_docs = [" ".join([d] * 6) for d in DOCS[:3]]
    for reuse in (True, False):
        alone = reranker.score(QUERY, [ANSWER], reuse=reuse)[0]
        among = reranker.score(QUERY, [*long_docs, ANSWER], reuse=reuse)[-1]
        assert among == pytest.approx(alone, abs=ATOL)


def test_ranks_the_answer_first(engine):
    # Holds with SmolLM2-135M-Instruct and the default template (margin ~0.2 nats
    # over the runner-up); a 135M model is a weak judge, so this is a sanity check.
    reranker = make(engine, top_n=3)
    ranked = reranker.rerank(QUERY, DOCS)
    assert len(ranked) == 3
    assert ranked[0][0] == DOCS.index(ANSWER)
    assert [s for _, s in ranked] == sorted((s for _, s in ranked), reverse=True)


def test_second_call_reuses_stored_prefixes(engine):
    store = MemoryKVStore()
    reranker = make(engine, store=store)
    reranker.score(QUERY, DOCS)
    encoded, hits = reranker.stats.prefixes_encoded, store.stats.hits
    reranker.score("Where is the Great Barrier Reef?", DOCS)
    assert reranker.stats.prefixes_encoded == encoded
    assert store.stats.hits == hits + len(DOCS)
    assert reranker.stats.prefixes_reused == len(DOCS)


def test_precompute_then_score(engine):
    reranker = make(engine)
    assert reranker.encode_documents([*DOCS, DOCS[0], "  "]) == len(DOCS)
    assert reranker.encode_documents(DOCS) == 0
    reranker.score(QUERY, DOCS)
    assert reranker.stats.prefixes_encoded == len(DOCS)


def test_prefix_keys_have_their_own_space(engine):
    reranker = KVReranker(engine, scoring="judge")  # shares engine.store
    assert reranker.store is engine.store
    assert reranker.fingerprint == f"{engine.fingerprint}|rerank|{DEFAULT_TEMPLATE.name}"
    upr = KVReranker(engine)  # the default scoring, with its own template
    assert upr.fingerprint == f"{engine.fingerprint}|rerank|upr-v1"
    assert upr.prefix_key(ANSWER) != reranker.prefix_key(ANSWER)
    assert reranker.prefix_key(ANSWER) != engine.chunk_key(ANSWER)
    other = KVReranker(engine, template="bge-gemma")
    assert other.prefix_key(ANSWER) != reranker.prefix_key(ANSWER)
    reranker.score(QUERY, [ANSWER])
    kv = engine.store.get(reranker.prefix_key(ANSWER), reranker.fingerprint)
    assert kv is not None and kv.num_tokens == reranker.prefix_ids(ANSWER).numel()


def test_default_prompt_is_the_chat_template_with_document_first(engine):
    reranker = make(engine)
    parts = DEFAULT_TEMPLATE.render(engine.tokenizer)
    t = DEFAULT_TEMPLATE
    messages = [
        {"role": "system", "content": t.system},
        {"role": "user", "content": f"{t.prefix}{ANSWER}{t.middle}{QUERY}{t.suffix}"},
    ]
    full = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert parts.before_document + ANSWER + parts.before_query + QUERY + parts.after_query == full
    assert full.index(ANSWER) < full.index(QUERY)
    assert parts.after_query.endswith("<|im_start|>assistant\n")
    # The prefix ids are the instruction's ids then the document's, each alone.
    prefix = reranker.prefix_ids(ANSWER)
    doc_ids = engine.tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    assert prefix[-len(doc_ids) :].tolist() == doc_ids


@pytest.mark.parametrize("name", sorted(set(TEMPLATES) - {"default"}))
def test_other_presets_reuse_exactly(engine, name):
    reranker = make(engine, template=name)
    docs = DOCS[:3]
    assert_close(reranker.score(QUERY, docs), reranker.score(QUERY, docs, reuse=False))


def test_space_before_document_moves_to_the_document(engine):
    reranker = make(engine, template=BGE_GEMMA_TEMPLATE)  # prefix "A: " ends with a space
    ids = reranker.prefix_ids("Canberra")
    assert engine.tokenizer.decode(ids) == "A: Canberra"
    spaced = engine.tokenizer(" Canberra", add_special_tokens=False)["input_ids"]
    assert ids[-len(spaced) :].tolist() == spaced


def test_empty_candidates(engine):
    reranker = make(engine)
    assert reranker.score(QUERY, []) == []
    assert reranker.rerank(QUERY, []) == []


def test_empty_document_scores_minus_inf_and_ranks_last(engine):
    reranker = make(engine)
    scores = reranker.score(QUERY, ["", ANSWER, "   \n"])
    assert scores[0] == -math.inf and scores[2] == -math.inf
    assert math.isfinite(scores[1])
    assert reranker.stats.scored == 1 and reranker.stats.prefixes_encoded == 1
    assert [i for i, _ in reranker.rerank(QUERY, ["", ANSWER, "   \n"])] == [1, 0, 2]
    assert reranker.score(QUERY, ["", " "]) == [-math.inf, -math.inf]


def test_duplicates_share_one_score_and_keep_their_index(engine):
    reranker = make(engine)
    docs = [DOCS[0], ANSWER, DOCS[0], ANSWER]
    scores = reranker.score(QUERY, docs)
    assert scores[0] == scores[2] and scores[1] == scores[3]
    assert reranker.stats.scored == 2
    ranked = reranker.rerank(QUERY, docs)
    assert sorted(i for i, _ in ranked) == [0, 1, 2, 3]


def test_bad_arguments(engine):
    reranker = make(engine)
    with pytest.raises(TypeError, match="documents"):
        reranker.score(QUERY, "one string")
    with pytest.raises(TypeError, match=r"documents\[1\]"):
        reranker.score(QUERY, ["ok", 3])
    with pytest.raises(TypeError, match="query"):
        reranker.score(None, DOCS)
    with pytest.raises(ValueError, match="query"):
        reranker.score("  ", DOCS)
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="top_n"):
            KVReranker(engine, top_n=bad)
        with pytest.raises(ValueError, match="top_n"):
            reranker.rerank(QUERY, DOCS[:1], top_n=bad)
    with pytest.raises(ValueError, match="batch_size"):
        KVReranker(engine, batch_size=0)
    with pytest.raises(ValueError, match="unknown rerank template"):
        KVReranker(engine, template="nope")
    with pytest.raises(ValueError, match="name"):
        RerankTemplate("", "a", "b", "c")


def test_top_n(engine):
    reranker = make(engine, top_n=2)
    assert len(reranker.rerank(QUERY, DOCS[:3])) == 2
    assert len(reranker.rerank(QUERY, DOCS[:3], top_n=None)) == 3
    assert len(make(engine).rerank(QUERY, DOCS[:3])) == 3


# ------------------------------------------------------- query likelihood (UPR)
def test_query_likelihood_is_the_mean_log_prob_of_the_query(engine):
    import torch

    reranker = make(engine, scoring="query_likelihood", batch_size=4)
    assert reranker.template.name == "upr-v1"
    cached = reranker.score(QUERY, DOCS)
    assert_close(cached, reranker.score(QUERY, DOCS, reuse=False))
    lead, query = reranker.prompt.query_ids(QUERY)
    expected = []
    for doc in DOCS:  # transformers' own forward, one prompt at a time
        ids = torch.cat([reranker.prefix_ids(doc), lead, query])
        with torch.no_grad():
            logits = engine.model(input_ids=ids[None]).logits[0].float()
        logp = torch.log_softmax(logits[-query.numel() - 1 : -1], dim=-1)
        expected.append(logp.gather(-1, query[:, None]).mean().item())
    assert_close(cached, expected)
    assert reranker.rerank(QUERY, DOCS, top_n=1)[0][0] == DOCS.index(ANSWER)


def test_query_likelihood_is_the_default_unless_a_judging_template_is_given(engine):
    store = MemoryKVStore()
    assert KVReranker(engine, store=store).scoring == "query_likelihood"
    assert KVReranker(engine, store=store).template.name == "upr-v1"
    assert KVReranker(engine, store=store, template="upr").scoring == "query_likelihood"
    assert KVReranker(engine, store=store, template="qwen3-reranker").scoring == "judge"
    assert KVReranker(engine, store=store, template="default").scoring == "judge"


def test_small_models_warn_and_scoring_is_checked(engine, caplog):
    with caplog.at_level("WARNING", logger="kvrag_integrations.rerank.reranker"):
        make(engine)
    assert "weak reranker" in caplog.text and "135M" in caplog.text
    assert "ranked worse than the retriever" in caplog.text  # the judge
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvrag_integrations.rerank.reranker"):
        make(engine, scoring="query_likelihood")
    assert "weak reranker" in caplog.text and "query-likelihood" in caplog.text
    with pytest.raises(ValueError, match="scoring"):
        make(engine, scoring="vibes")

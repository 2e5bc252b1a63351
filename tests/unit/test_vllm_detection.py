"""The server's detection of stored passages in plain requests, without vLLM.

A real ``ContentIndex`` and a set of stored keys; the prompts are token ids laid
out as a RAG template lays them: a head, passages with glue between them, a
question. What is planned is checked against the ids (every piece's entry ids
are the ones of an entry stored). The hook around it: ``test_vllm_reuse_hook.py``.
"""

from __future__ import annotations

import random

from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.matching import ContentIndex
from kvrag_integrations.vllm.params import PieceSpec
from kvrag_integrations.vllm.server.detection import Detector, Own
from kvrag_integrations.vllm.trust import Tenant

FP = "fp+kv-float16"
rng = random.Random(0)


def ids(n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


HEAD, GLUE, TAIL = ids(40), [198, 198], [2, 198, 1, 4093, 198]
PASSAGES = [ids(120 + 10 * i) for i in range(5)]


def prompt(order: list[int], question: list[int], glue: list[int] = GLUE) -> list[int]:
    out = list(HEAD)
    for i in order:  # the head ends as the glue does ("...context:\n\n"), as templates do
        out += glue + PASSAGES[i]
    return out + TAIL + question


class Stored:
    """Keys of stored entries, and the index of their ids (what a worker announces)."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.index = ContentIndex()

    def put(self, entry: list[int], fp: str = FP) -> None:
        self.keys.add(cache_key(fp, entry))
        self.index.add(fp, entry)

    def detector(self, **kw) -> Detector:
        return Detector(self.index, self.keys.__contains__, FP, **kw)


def check_pieces(pieces: tuple[PieceSpec, ...], prompt_ids: list[int], stored: Stored) -> int:
    """Every piece follows the last, and reads an entry that is stored."""
    position = 0
    for piece in pieces:
        assert piece.start == position
        assert cache_key(FP, piece.entry_ids(prompt_ids)) in stored.keys
        position = piece.end
    return position


def test_a_prompt_without_stored_passages_is_learned_whole_and_loads_nothing() -> None:
    stored = Stored()
    stored.put(ids(200))  # something else
    p = prompt([0, 1, 2], ids(12))
    plan = stored.detector().detect(FP, p, keeps=True)
    assert plan.load == () and plan.learn_prompt
    assert not stored.detector().detect(FP, p, keeps=False).learn_prompt  # a reader
    assert not stored.detector().detect(FP, p[:100], keeps=True).learn_prompt  # short


def test_a_learned_prompt_serves_its_passages_in_another_order_and_a_new_question() -> None:
    stored = Stored()
    first = prompt([0, 1, 2, 3], ids(12))
    stored.put(first)  # what the first request stored
    second = prompt([2, 0, 3, 1], ids(15))
    plan = stored.detector().detect(FP, second, keeps=True)
    end = check_pieces(plan.load, second, stored)
    # everything up to the question (and the template's tail before it) comes from storage
    assert end >= len(second) - 15 - len(TAIL)
    assert plan.load[0].lead == ()  # the head: rows 0.. of the stored prompt (exact)
    assert not plan.learn_prompt and plan.remainder == ()


def test_ingested_passages_with_unknown_glue_and_head_teach_both() -> None:
    stored = Stored()
    for passage in PASSAGES:
        stored.put([*passage, 4093])  # ingested with a suffix the template does not use
    p = prompt([1, 3, 0], ids(12))
    plan = stored.detector().detect(FP, p, keeps=True)
    # the head is unknown: nothing loads, the prompt is stored whole, the glue learned
    # and the prompt's prefix up to the first passage encoded (exact) before it is planned
    first = p.index(PASSAGES[1][0])
    assert plan.load == () and plan.learn_prompt and plan.glue == (tuple(p[:first]), tuple(GLUE))
    unbounded = stored.detector(max_prefix_tokens=first - 1).detect(FP, p, keeps=True)
    assert unbounded.glue == (tuple(GLUE),)  # a longer prefix is not encoded first
    stored.put(GLUE)
    stored.put(HEAD + GLUE)  # (a head learned on its own, as a short template's would be)
    plan = stored.detector().detect(FP, p, keeps=True)
    end = check_pieces(plan.load, p, stored)
    assert end == len(p) - 12 - len(TAIL)  # the passages and glue: up to the template's tail
    passage = plan.load[1]
    assert passage.tail == (4093,) and passage.lead == ()


def agent_call() -> tuple[Stored, list[int], int]:
    """An agent's second model call over ingested passages: head, a new question and
    the tool call (long, unknown), then the passages its tool returned; and where
    they begin."""
    stored = Stored()
    for passage in PASSAGES:
        stored.put(passage)
    stored.put(GLUE)
    p = HEAD + ids(60) + GLUE + PASSAGES[2] + GLUE + PASSAGES[0] + TAIL
    return stored, p, p.index(PASSAGES[2][0])


def test_a_tenants_question_and_tool_call_before_stored_passages_are_learned_first() -> None:
    """In a tenant's own namespace the prefix up to the passages is learned as glue
    (exact: from position 0), then everything before the template's tail loads."""
    stored, p, first = agent_call()
    plan = stored.detector().detect(FP, p, keeps=True)
    assert plan.load == () and plan.glue == (tuple(p[:first]),) and plan.prefix == first
    assert not stored.detector().detect(FP, p, keeps=False).glue  # a reader stores none
    stored.put(p[:first])  # what the hook's encode of that glue stores
    plan = stored.detector().detect(FP, p, keeps=True)
    assert check_pieces(plan.load, p, stored) == len(p) - len(TAIL)
    assert plan.load[0] == PieceSpec(0, first)  # the prefix: its own exact entry


OWN = "fp+kv-float16+ns-own"  # a request's private namespace


def test_a_private_requests_prefix_and_glue_are_its_own_and_lead_the_load() -> None:
    """A request with a private namespace (an anonymous caller) has every text it
    brings before and between found passages encoded for it alone, never from
    the tenant's namespace; once they are (``Own.ready``), its load reads them
    from its own namespace, under its secret suffix, and the passages after them."""
    stored, p, first = agent_call()
    tail = tuple(ids(24))
    own = Own(OWN, tail)
    plan = stored.detector().detect(FP, p, False, own)
    # (the glue is stored in the tenant's namespace, yet encoded for the request too)
    assert plan.prefix == first and plan.load == ()
    assert plan.glue == (tuple(p[:first]), tuple(GLUE)) and not plan.learn_prompt
    ready = Own(OWN, tail, frozenset(plan.glue))
    plan = stored.detector().detect(FP, p, False, ready)
    assert plan.load_end == len(p) - len(TAIL)
    assert plan.load[0] == PieceSpec(0, first, tail, own=True)
    for piece in plan.load:  # its own pieces end in its suffix; the passages are stored
        if piece.own:
            assert piece.entry_ids(p)[-24:] == list(tail)
        else:
            assert cache_key(FP, piece.entry_ids(p)) in stored.keys
    assert [q.own for q in plan.load] == [True, False, True, False]
    # too little found after a long prefix is not worth its encode
    short = HEAD + ids(60) + GLUE + PASSAGES[2][:40] + ids(80)
    assert stored.detector().detect(FP, short, False, own).prefix == 0
    # a reader (neither keeps nor has a namespace of its own) encodes nothing
    assert stored.detector().detect(FP, p, False).glue == ()


def test_unknown_text_between_passages_stops_the_load_and_is_learned() -> None:
    stored = Stored()
    stored.put(prompt([0, 1], ids(10)))
    new = ids(300)
    p = HEAD + GLUE + PASSAGES[1] + GLUE + PASSAGES[0] + GLUE + new + GLUE + PASSAGES[1] + TAIL
    plan = stored.detector(min_share=0.1).detect(FP, p, keeps=True)
    end = check_pieces(plan.load, p, stored)
    assert end == p.index(new[0])  # (the glue after P0 comes with it: stored so too)
    assert plan.remainder == (tuple(p[end:]),)  # the remainder, encoded in the background


def test_entries_the_store_lost_are_forgotten_and_tenants_see_only_their_own() -> None:
    stored = Stored()
    first = prompt([0, 1, 2], ids(10))
    stored.put(first)
    stored.keys.clear()  # evicted since it was indexed
    plan = stored.detector().detect(FP, prompt([1, 0, 2], ids(9)), keeps=True)
    assert plan.load == () and len(stored.index) == 0
    other = Tenant.of_salt("team-b").fingerprint(FP)
    stored.put(first, other)
    assert stored.detector().detect(FP, prompt([1, 0, 2], ids(9)), True).load == ()


def test_a_passage_stored_after_text_this_prompt_lacks_is_not_read_from_there() -> None:
    """Rows carry what they attended to: a passage inside a stored prompt after an
    injected instruction is not loaded into a prompt without that instruction."""
    stored = Stored()
    injection = ids(40)
    stored.put(HEAD + GLUE + injection + GLUE + PASSAGES[0] + GLUE + PASSAGES[1] + TAIL)
    victim = prompt([1, 0], ids(12))
    plan = stored.detector().detect(FP, victim, keeps=True)
    end = check_pieces(plan.load, victim, stored)
    assert end <= len(HEAD) + len(GLUE)  # only the head (what the victim sent too)
    # the same passages after text the victim does send are read as before
    stored.put(prompt([0, 1], ids(10)))
    plan = stored.detector().detect(FP, victim, keeps=True)
    assert check_pieces(plan.load, victim, stored) >= len(victim) - 12 - len(TAIL)


def test_a_passage_continued_after_markup_vllm_rendered_from_it_is_not_loaded() -> None:
    """A hostile passage holds the template's markup as text: ingested, it is stored
    as characters; vLLM renders the request's copy of it as control tokens. The
    passage's text before the markup loads; its text after, read from inside the
    entry right after a control token it does not hold, does not (issue 51)."""
    stored = Stored()
    passage = ids(200)
    stored.put(passage)
    markup = [2, 198, 1]  # <|im_end|>\n<|im_start|> as vLLM renders them
    stored.put(HEAD + GLUE + passage[:100] + markup)  # even were it learned, glue and all
    p = HEAD + GLUE + passage[:100] + markup + passage[103:] + TAIL + ids(12)
    after = [p.index(passage[103]), len(p)]

    def loads_after(detector: Detector) -> bool:
        plan = detector.detect(FP, p, keeps=False)
        check_pieces(plan.load, p, stored)
        return any(piece.end > after[0] for piece in plan.load)

    assert loads_after(stored.detector())  # without the check: read from inside the entry
    assert not loads_after(stored.detector(control_ids=frozenset({1, 2})))

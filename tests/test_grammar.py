"""Guided decoding (runtime.grammar) through Decoding: JSON and Kimi tool calls on random weights,
where only the mask can make the output valid; speculation and batching change nothing; bad schemas
are refused with the field named; logprobs are the model's."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from deltafin.runtime.generate import Decoding, generate
from deltafin.runtime.grammar import Constraint, GrammarError, Matcher, _compile, _vocab
from deltafin.runtime.tool_calls import (ARGS_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, THINK_BEGIN,
                                         THINK_END)
from deltafin.runtime.sampling import SamplingParams
from deltafin.runtime.scheduler import Scheduler
from deltafin.tokenizer import KimiTokenizer

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "where": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                   "score": {"type": "number", "minimum": -5, "maximum": 5}},
                  "required": ["zip", "score"], "additionalProperties": False}},
     "required": ["tags", "where"], "additionalProperties": False},
    {"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "null"}]},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "kind": {"const": "point"},
        "xy": {"type": "array", "items": False, "minItems": 2,
               "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 99}] * 2},
        "label": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["kind", "xy", "label"], "additionalProperties": False},
]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "b": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: an empty object
TOOLS = [WEATHER, ADD, PING]
CALL = re.compile(re.escape(CALL_BEGIN) + r"functions\.([A-Za-z0-9_-]+):(\d+)" + re.escape(ARGS_BEGIN)
                  + r"(.*?)" + re.escape(CALL_END), re.S)


@pytest.fixture(scope="module")
def model(tiny_k3_model):
    return tiny_k3_model


def _prompt(model, seed: int, n: int = 6) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 480, (n,), generator=g).tolist()  # ordinary (non-special) tokens


def _calls(text: str) -> list[tuple[str, int, str]]:
    """(name, index, arguments) of a complete section that is the whole text."""
    assert text.startswith(SECTION_BEGIN) and text.endswith(SECTION_END), text
    body = text[len(SECTION_BEGIN):-len(SECTION_END)]
    calls = [(m.group(1), int(m.group(2)), m.group(3)) for m in CALL.finditer(body)]
    assert "".join(m.group(0) for m in CALL.finditer(body)) == body, text  # nothing between the calls
    return calls


def _schema_of(name: str) -> dict:
    fn = {t["function"]["name"]: t["function"] for t in TOOLS}[name]
    return fn.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False})


# -- JSON ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_json_schema_outputs_always_parse_and_validate(model, k):
    schema = SCHEMAS[k]
    c = Constraint.json_schema(schema)
    runs = [SamplingParams(max_new_tokens=300, constraint=c)]
    runs += [SamplingParams(max_new_tokens=300, constraint=c, temperature=1.0, seed=s) for s in range(6)]
    for i, params in enumerate(runs):
        g = generate(model, _prompt(model, 100 * k + i), params)
        assert g.finish_reason == "stop", (g.finish_reason, g.text)
        jsonschema.validate(json.loads(g.text), schema)
        # the output ended where the JSON did; the state holds the prompt and all but the last token
        assert g.tokens == g.generated
        assert g.state.num_tokens == 6 + len(g.generated) - 1


def test_json_object_is_any_object(model):
    for seed in range(4):
        g = generate(model, _prompt(model, seed), SamplingParams(max_new_tokens=400, temperature=0.7, seed=seed,
                                                                  constraint=Constraint.json_object()))
        if g.finish_reason == "stop":
            assert isinstance(json.loads(g.text), dict)
        else:  # random weights may write one long string: what there is must still be JSON so far
            assert g.finish_reason == "length" and g.text.lstrip().startswith("{")


# -- tool calls ----------------------------------------------------------------------------------
def test_tool_choice_required_calls_always_validate(model):
    c = Constraint.tool_calls(TOOLS, "required")
    calls = 0
    runs = [SamplingParams(max_new_tokens=400, constraint=c)]
    runs += [SamplingParams(max_new_tokens=400, constraint=c, temperature=1.0, seed=s) for s in range(10)]
    for i, params in enumerate(runs):
        g = generate(model, _prompt(model, 500 + i), params)
        assert g.finish_reason == "tool_calls", (g.finish_reason, g.text)
        found = _calls(g.text)
        assert found and [idx for _, idx, _ in found] == list(range(len(found)))  # functions.NAME:0, :1, ...
        for name, _, args in found:
            jsonschema.validate(json.loads(args), _schema_of(name))
        calls += len(found)
    assert calls >= len(runs)


def test_a_named_function_is_called_once_with_its_ids_counted_from_the_history(model):
    c = Constraint.tool_calls(TOOLS, {"type": "function", "function": {"name": "add"}}, first_index=4)
    for seed in range(4):
        g = generate(model, _prompt(model, seed), SamplingParams(max_new_tokens=200, constraint=c, temperature=1.0,
                                                                  seed=seed))
        assert g.finish_reason == "tool_calls"
        (name, idx, args), = _calls(g.text)
        assert (name, idx) == ("add", 4)
        jsonschema.validate(json.loads(args), _schema_of("add"))


def test_parallel_tool_calls_off_allows_one_call(model):
    c = Constraint.from_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    for seed in range(4):
        g = generate(model, _prompt(model, seed), SamplingParams(max_new_tokens=200, constraint=c, temperature=1.0,
                                                                  seed=seed))
        assert g.finish_reason == "tool_calls" and len(_calls(g.text)) == 1


def _ids(model, text: str) -> list[int]:
    return model.tokenizer.encode(text)


def _section(*calls) -> str:
    return SECTION_BEGIN + "".join(f"{CALL_BEGIN}functions.{n}:{i}{ARGS_BEGIN}{a}{CALL_END}"
                                   for n, i, a in calls) + SECTION_END


def test_auto_leaves_text_free_and_constrains_a_section_once_begun(model):
    tok, eos = model.tokenizer, set(model.config.eos_token_ids)
    c = Constraint.tool_calls(TOOLS, "auto")
    m = Matcher(c, tok, model.config.vocab_size, eos)
    text = _ids(model, "Let me look that up.")
    allowed = m.allowed()
    assert all(allowed[t] for t in text) and all(allowed[t] for t in eos)
    assert not any(allowed[tok.special_tokens[n]] for n in (CALL_BEGIN, ARGS_BEGIN, CALL_END, SECTION_END))
    good = text + _ids(model, _section(("get_weather", 0, '{"city": "Paris", "unit": "c"}'),
                                       ("add", 1, '{"a": 1, "b": -2}')))
    assert m.legal_prefix(good) == len(good)
    for t in good:
        m.advance(t)
    assert m.done and m.finish_reason == "tool_calls"
    # inside a section: an unknown function, a wrong id, arguments against the schema, an early end
    bad_cases = [_section(("get_wether", 0, "{}")), _section(("add", 1, '{"a": 1, "b": 2}')),
                 _section(("add", 0, '{"a": 1, "b": 200}')), _section(("add", 0, '{"a": 1}')),
                 _section(("ping", 0, '{"x": 1}'))]
    for bad in bad_cases:
        m = Matcher(c, tok, model.config.vocab_size, eos)
        ids = _ids(model, bad)
        n = m.legal_prefix(ids)
        assert n < len(ids), bad
        prefix = ids[:n]
        for t in prefix:
            m.advance(t)
        assert not m.allowed()[ids[n]]
        assert not any(m.allowed()[t] for t in eos)  # a begun section cannot just end


def test_tool_choice_none_masks_every_tool_token(model):
    tok = model.tokenizer
    m = Matcher(Constraint.tool_calls(TOOLS, "none"), tok, model.config.vocab_size, {481})
    allowed = m.allowed()
    assert not any(allowed[tok.special_tokens[n]] for n in (SECTION_BEGIN, CALL_BEGIN, SECTION_END))
    assert allowed[481] and allowed.sum() == model.config.vocab_size - 5


def test_auto_with_a_json_answer_is_a_call_or_that_json(model):
    schema = SCHEMAS[0]
    c = Constraint.from_request({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
                                TOOLS, "auto")
    for seed in range(6):
        g = generate(model, _prompt(model, seed), SamplingParams(max_new_tokens=300, constraint=c, temperature=1.0,
                                                                  seed=seed))
        if g.finish_reason == "tool_calls":
            for name, _, args in _calls(g.text):
                jsonschema.validate(json.loads(args), _schema_of(name))
        else:
            assert g.finish_reason == "stop"
            jsonschema.validate(json.loads(g.text), schema)


def test_a_thinking_block_may_come_first_and_cannot_end_the_output(model):
    tok, eos = model.tokenizer, {481, 482}
    c = Constraint.tool_calls(TOOLS, "required", thinking=True)
    m = Matcher(c, tok, model.config.vocab_size, eos)
    assert m.allowed()[tok.special_tokens[THINK_BEGIN]]
    ids = _ids(model, THINK_BEGIN + "the user wants a sum" + THINK_END + _section(("add", 0, '{"a": 2, "b": 3}')))
    assert m.legal_prefix(ids) == len(ids)
    m.advance(ids[0])
    assert not any(m.allowed()[t] for t in eos)
    # a prompt that ends in <think> starts inside the block
    m = Matcher(c, tok, model.config.vocab_size, eos, context=ids[:1])
    assert m.legal_prefix(ids[1:]) == len(ids) - 1
    # without the flag, a thinking block is not allowed
    m = Matcher(Constraint.tool_calls(TOOLS, "required"), tok, model.config.vocab_size, eos)
    assert not m.allowed()[tok.special_tokens[THINK_BEGIN]]


def test_special_text_keeps_the_tool_and_thinking_tokens_only(model):
    ids = _ids(model, THINK_BEGIN + "hm" + THINK_END + "ok" + _section(("ping", 0, "{}")) + "<|im_user|>")
    truth = list(ids)

    class Scripted:
        """The model's passes with logits that put ``truth`` first."""

        def __init__(self):
            self.config, self.settings, self.tokenizer = model.config, model.settings, model.tokenizer
            self.n = 0

        def new_state(self):
            return model.new_state()

        def forward_batch(self, seqs):
            out = model.forward_batch(seqs)
            logits = torch.full_like(out[0][-1:], -10.0)
            logits[0, truth[self.n] if self.n < len(truth) else 481] = 10.0
            self.n += 1
            return [logits]

    for keep, want in [(True, THINK_BEGIN + "hm" + THINK_END + "ok" + _section(("ping", 0, "{}"))),
                       (False, "hmokfunctions.ping:0{}")]:
        g = generate(Scripted(), [1, 2], SamplingParams(max_new_tokens=len(truth) + 1, speculate=False),
                     special_text=keep)
        assert g.tokens == truth and g.text == want  # <|im_user|> (no text token) never shows
    # a tool-call constraint turns it on
    assert Constraint.tool_calls(TOOLS, "auto").special_text and not Constraint.json_object().special_text


# -- speculation and batching ----------------------------------------------------------------------
def _oracle(prompt, truth, wrong_every: int = 0):
    """Drafts the true continuation (some tokens replaced by a wrong one, often an illegal one)."""
    def drafter(context, n):
        done = len(context) - len(prompt)
        draft = list(truth[done:done + n])
        if wrong_every:
            draft = [(t + 7) % 480 if (done + i) % wrong_every == wrong_every - 1 else t for i, t in enumerate(draft)]
        return draft
    return drafter


@pytest.mark.parametrize("constraint", [Constraint.json_schema(SCHEMAS[1]), Constraint.tool_calls(TOOLS, "required"),
                                        Constraint.tool_calls(TOOLS, "auto")])
def test_speculation_with_a_constraint_equals_the_constraint_alone(model, constraint):
    for seed in range(3):
        prompt = _prompt(model, 900 + seed)
        alone = generate(model, prompt, SamplingParams(max_new_tokens=120, constraint=constraint, speculate=False))
        spec = generate(model, prompt, SamplingParams(max_new_tokens=120, constraint=constraint, speculate=True))
        assert (spec.tokens, spec.finish_reason) == (alone.tokens, alone.finish_reason)
        for wrong in (0, 3):
            g = generate(model, prompt, SamplingParams(max_new_tokens=120, constraint=constraint, speculate=True),
                         drafter=_oracle(prompt, alone.generated, wrong))
            assert (g.tokens, g.finish_reason) == (alone.tokens, alone.finish_reason)
            assert g.state.num_tokens == alone.state.num_tokens
            if wrong == 0:
                assert g.stats["accepted_draft_tokens"] >= len(alone.generated) // 2


def test_forced_tokens_are_drafted(model):
    """A named call's prefix (section, call, "functions.add:0", the argument token, '{"a":') is forced:
    drafted and accepted, several tokens a pass."""
    c = Constraint.tool_calls(TOOLS, {"name": "add"})
    g = generate(model, _prompt(model, 3), SamplingParams(max_new_tokens=100, constraint=c, speculate=True))
    alone = generate(model, _prompt(model, 3), SamplingParams(max_new_tokens=100, constraint=c, speculate=False))
    assert g.tokens == alone.tokens and g.finish_reason == "tool_calls"
    assert g.stats["accepted_draft_tokens"] > 0 and g.stats["passes"] < alone.stats["passes"]


def test_a_batch_of_constrained_and_free_sequences_equals_each_alone(model):
    requests = [
        (_prompt(model, 1), SamplingParams(max_new_tokens=60, constraint=Constraint.json_schema(SCHEMAS[0]))),
        (_prompt(model, 2), SamplingParams(max_new_tokens=40)),
        (_prompt(model, 3), SamplingParams(max_new_tokens=80, constraint=Constraint.tool_calls(TOOLS, "required"),
                                           temperature=0.8, seed=5)),
        (_prompt(model, 4), SamplingParams(max_new_tokens=30, temperature=1.0, seed=9, logprobs=3)),
        (_prompt(model, 5), SamplingParams(max_new_tokens=80, constraint=Constraint.json_schema(SCHEMAS[2]),
                                           logprobs=2)),
    ]
    alone = [generate(model, p, params) for p, params in requests]
    sched = Scheduler(model, 8, 16)
    try:
        got = [f.result(timeout=300) for f in [sched.submit(p, params) for p, params in requests]]
    finally:
        sched.close()
    assert sched.passes < sum(len(a.generated) for a in alone)  # the sequences shared passes
    for g, want in zip(got, alone):
        assert (g.tokens, g.finish_reason, g.text) == (want.tokens, want.finish_reason, want.text)
        if want.logprobs is not None:
            for (t, lp, top), (wt, wlp, wtop) in zip(g.logprobs, want.logprobs):
                assert t == wt and lp == pytest.approx(wlp, abs=1e-4)
                assert [i for i, _ in top] == [i for i, _ in wtop]


# -- logprobs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("constraint", [None, Constraint.json_schema(SCHEMAS[0])])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_the_log_softmax_of_the_models_logits(model, constraint, temperature):
    prompt = _prompt(model, 11)
    params = SamplingParams(max_new_tokens=12, constraint=constraint, temperature=temperature, seed=3, logprobs=5)
    g = generate(model, prompt, params)
    assert len(g.logprobs) == len(g.tokens) > 0
    m = None if constraint is None else Matcher(constraint, model.tokenizer, model.config.vocab_size,
                                                set(model.config.eos_token_ids))
    logits = model.logits(prompt + g.tokens)[len(prompt) - 1:-1]
    for row, t, (token, lp, top) in zip(logits, g.tokens, g.logprobs):
        if m is not None:  # the mask applies: a forbidden token has no probability
            row = row.masked_fill(~m.allowed(), float("-inf"))
            m.advance(t)
        want = torch.log_softmax(row, -1)  # not scaled by the temperature: the model's own distribution
        assert token == t and lp == pytest.approx(want[t].item(), abs=1e-4)
        top_lp, top_ids = want.topk(5)
        top_want = [(i, v) for i, v in zip(top_ids.tolist(), top_lp.tolist()) if v != float("-inf")]
        assert [i for i, _ in top] == [i for i, _ in top_want]
        assert [v for _, v in top] == pytest.approx([v for _, v in top_want], abs=1e-4)
        if temperature == 0:
            assert top[0][0] == t


def test_logprobs_zero_gives_the_chosen_tokens_only(model):
    g = generate(model, _prompt(model, 2), SamplingParams(max_new_tokens=5, logprobs=0, speculate=True))
    assert [t for t, _, _ in g.logprobs] == g.tokens and all(top == [] for _, _, top in g.logprobs)
    assert generate(model, _prompt(model, 2), SamplingParams(max_new_tokens=5)).logprobs is None


def test_on_logprob_comes_with_each_returned_token_before_its_text(model):
    events = []
    params = SamplingParams(max_new_tokens=20, logprobs=2, stop=("e",), constraint=Constraint.json_object())
    g = generate(model, _prompt(model, 4), params, on_logprob=lambda e: events.append(("lp", e)),
                 on_token=lambda t, text: events.append(("token", t)))
    assert events == [x for e, t in zip(g.logprobs, g.tokens) for x in (("lp", e), ("token", t))]
    with pytest.raises(ValueError, match="on_logprob"):
        Decoding(model, [1], SamplingParams(), on_logprob=print)


def test_logprobs_are_checked():
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)


# -- bad schemas and requests --------------------------------------------------------------------
@pytest.mark.parametrize("schema, param", [
    ({"type": "object", "properties": {"x": {"type": "strin"}}}, "properties.x.type"),
    ({"type": "object", "properties": {"x": {"type": "array", "items": {"type": "string", "pattern": "(("}}}},
     "properties.x.items.pattern"),
    ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "properties.x.not"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]},
     "properties.n"),
    ({"anyOf": [{"type": "string"}, {"$ref": "#/$defs/missing"}]}, "anyOf[1]"),
    ({"type": "object", "required": "x"}, "required"),
])
def test_bad_schemas_are_refused_with_the_field_named(schema, param):
    with pytest.raises(GrammarError) as e:
        Constraint.json_schema(schema)
    assert e.value.param == "response_format.json_schema.schema." + param
    assert isinstance(e.value, ValueError) and e.value.param in str(e.value)


def test_unsupported_keywords_are_ignored_when_not_strict():
    Constraint.json_schema({"type": "array", "uniqueItems": True}, strict=False)
    bad = dict(ADD["function"], parameters={"type": "object", "properties": {"x": {"not": {"type": "string"}}}})
    Constraint.tool_calls([{"type": "function", "function": bad}])  # a tool is strict only when it says so
    with pytest.raises(GrammarError) as e:
        Constraint.tool_calls([WEATHER, ADD, {"type": "function", "function": dict(bad, name="x", strict=True)}])
    assert e.value.param == "tools[2].function.parameters.properties.x.not"


@pytest.mark.parametrize("call, param", [
    (lambda: Constraint.tool_calls([WEATHER, {"type": "function", "function": {"name": "bad name"}}]),
     "tools[1].function.name"),
    (lambda: Constraint.tool_calls([WEATHER, WEATHER]), "tools[1].function.name"),
    (lambda: Constraint.tool_calls([{"type": "retrieval"}]), "tools[0].type"),
    (lambda: Constraint.tool_calls([WEATHER, {"type": "function", "function": dict(
        ADD["function"], parameters={"type": "object", "properties": {"a": {"type": "intger"}}})}]),
     "tools[1].function.parameters.properties.a.type"),
    (lambda: Constraint.tool_calls([]), "tools"),
    (lambda: Constraint.tool_calls(TOOLS, {"name": "nope"}), "tool_choice"),
    (lambda: Constraint.tool_calls(TOOLS, "sometimes"), "tool_choice"),
    (lambda: Constraint.tool_calls(TOOLS, first_index=-1), "first_index"),
    (lambda: Constraint.from_request(tool_choice="required"), "tool_choice"),
    (lambda: Constraint.from_request({"type": "yaml"}), "response_format.type"),
    (lambda: Constraint.from_request({"type": "json_schema", "json_schema": {"schema": []}}),
     "response_format.json_schema"),
    (lambda: Constraint.from_request({"type": "json_schema", "json_schema": {"schema": {"type": 3}}}),
     "response_format.json_schema.schema.type"),
])
def test_bad_tool_requests_are_refused_with_the_field_named(call, param):
    with pytest.raises(GrammarError) as e:
        call()
    assert e.value.param == param


def test_from_request():
    assert Constraint.from_request() is None
    assert Constraint.from_request({"type": "text"}, None, "none") is None
    assert Constraint.from_request({"type": "json_object"}) == Constraint.json_object()
    assert Constraint.from_request(tools=TOOLS) == Constraint.tool_calls(TOOLS, "auto")
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS[0], "strict": True}}
    assert Constraint.from_request(schema, TOOLS, "none") == Constraint.json_schema(SCHEMAS[0])
    assert Constraint.from_request(schema, TOOLS, "required") == Constraint.tool_calls(TOOLS, "required")
    c = Constraint.from_request(schema, TOOLS, "auto", first_index=2)
    assert c.schema is not None and c.tools is not None and c.first_index == 2
    # a function may be called like a mode
    odd = [{"type": "function", "function": {"name": "none"}}, {"type": "function", "function": {"name": "auto"}}]
    c = Constraint.from_request(tools=odd, tool_choice={"type": "function", "function": {"name": "none"}})
    assert (c.choice, c.function, c.calls_tools) == ("function", "none", True)
    assert Constraint.from_request(tools=TOOLS, parallel_tool_calls=None).parallel  # OpenAI's null: the default
    # OpenAI's default: a json_schema response_format is not strict
    assert not Constraint.from_request({"type": "json_schema", "json_schema": {"schema": SCHEMAS[0]}}).strict


def test_constraints_are_hashable_and_compiled_once(model):
    a, b = Constraint.json_schema(dict(SCHEMAS[0])), Constraint.json_schema(json.loads(json.dumps(SCHEMAS[0])))
    assert a == b and hash(a) == hash(b)
    assert hash(SamplingParams(constraint=a, logprobs=3)) == hash(SamplingParams(constraint=b, logprobs=3))
    vocab = _vocab(model.tokenizer, model.config.vocab_size)
    assert _compile(vocab, a) is _compile(vocab, b)


def test_a_model_without_tool_tokens_cannot_call_tools(model, tmp_path):
    """A tokenizer that lacks the tool-call tokens refuses a tool constraint when the generation
    starts (the tools themselves were fine)."""
    conf = json.loads((model.path / "tokenizer_config.json").read_text())
    conf["added_tokens_decoder"] = {k: v for k, v in conf["added_tokens_decoder"].items()
                                    if v["content"] not in (SECTION_BEGIN, SECTION_END)}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(conf))
    (tmp_path / "tiktoken.model").write_bytes((model.path / "tiktoken.model").read_bytes())
    tok = KimiTokenizer(tmp_path)
    c = Constraint.tool_calls(TOOLS, "required")
    with pytest.raises(GrammarError, match="no <|tool_calls_section_begin|>") as e:
        Matcher(c, tok, model.config.vocab_size, {481})
    assert e.value.param == "tools"
    Matcher(Constraint.json_object(), tok, model.config.vocab_size, {481})  # JSON needs no special token


def test_model_generate_takes_openai_fields(model):
    prompt = _prompt(model, 21)
    ids = model.generate(prompt, max_new_tokens=200, tools=TOOLS, tool_choice="required", logprobs=1)
    assert model.last_generation_stats["finish_reason"] == "tool_calls"
    assert len(model.last_generation_stats["logprobs"]) == len(ids)
    text = model.tokenizer.decode(ids)
    for name, _, args in _calls(text):
        jsonschema.validate(json.loads(args), _schema_of(name))
    ids = model.generate(prompt, max_new_tokens=200,
                         response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}})
    jsonschema.validate(json.loads(model.decode(ids)), SCHEMAS[0])
    with pytest.raises(TypeError, match="not both"):
        model.generate(prompt, SamplingParams(constraint=Constraint.json_object()),
                       response_format={"type": "json_object"})


def test_decoding_needs_a_tokenizer_for_a_constraint(model):
    class Bare:
        config, settings, tokenizer = model.config, model.settings, None

        def new_state(self):
            return model.new_state()

    with pytest.raises(ValueError, match="tokenizer"):
        Decoding(Bare(), [1, 2], SamplingParams(constraint=Constraint.json_object()))

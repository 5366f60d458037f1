"""Structured output: the mask in the jitted sampler, specs, the request mapping, and real-model JSON."""

import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxsmol.cli.api.structured_request import structured_from_request
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime import schema_bounds
from jaxsmol.runtime.sampling import SamplingParams, unpack_bitmask
from jaxsmol.runtime.structured import all_allowed, canonical_spec, constraint_for, pack_bits, unpack_bits
from jaxsmol.cache.scheduler.many import generate
from draws import draws

# ---- the mask inside the sampler (tiny shapes, no model) -------------------------------------------

def _draws(logits, allowed, n, temperature=1.0, top_k=0, top_p=1.0):
    """[n, B] samples of logits [B, V] under a packed mask, each draw with its own seed."""
    return draws(logits, n, temperature, top_k, top_p, allowed)


def test_pack_and_unpack_round_trip():
    unpack = jax.jit(unpack_bitmask, static_argnums=1)  # as the sampler runs it: one program a shape
    rng = np.random.default_rng(0)
    for V in (1, 31, 32, 33, 256, 1000):
        allowed = rng.random((3, V)) < 0.3
        packed = pack_bits(allowed)
        assert packed.dtype == np.int32 and packed.shape == (3, -(-V // 32))
        np.testing.assert_array_equal(unpack_bits(packed, V), allowed)
        np.testing.assert_array_equal(np.asarray(unpack(jnp.asarray(packed), V)), allowed)
    # a mask narrower than the logits (a tokenizer smaller than the model's head) leaves the rest out
    wide = np.asarray(unpack(jnp.asarray(all_allowed(1, 64)), 100))
    assert wide[0, :64].all() and not wide[0, 64:].any()


def test_mask_is_honoured_greedy_and_sampled(tiny_cfg):
    V = tiny_cfg.vocab_size
    logits = np.random.default_rng(1).standard_normal((2, V)).astype(np.float32) * 3
    allowed = np.zeros((2, V), bool)
    allowed[0, [3, 17, 200]] = True
    allowed[1, [V - 1]] = True
    packed = pack_bits(allowed)
    greedy = _draws(logits, packed, 300, temperature=0.0)  # 300 draws: the shape below, one program
    assert (greedy == greedy[0]).all()
    greedy = greedy[0]
    assert greedy[0] == [3, 17, 200][int(np.argmax(logits[0, [3, 17, 200]]))] and greedy[1] == V - 1
    for settings in (dict(), dict(temperature=2.0), dict(top_k=5), dict(top_k=100, top_p=0.9), dict(top_p=0.3)):
        got = _draws(logits, packed, 300, **settings)
        assert set(got[:, 0]) <= {3, 17, 200} and set(got[:, 1]) == {V - 1}, settings
    assert set(_draws(logits, packed, 300, temperature=5.0)[:, 0]) == {3, 17, 200}  # all allowed ids occur


def test_all_allowed_mask_changes_nothing(tiny_cfg):
    """The mask of a row without structured output allows every id: its draws are those of every id
    allowed one by one."""
    V = tiny_cfg.vocab_size
    logits = np.random.default_rng(2).standard_normal((1, V)).astype(np.float32)
    every = pack_bits(np.ones((1, V), bool))
    np.testing.assert_array_equal(all_allowed(1, V), every)
    # 600 draws of the one row: the 600 rows of test_mask_is_honoured_greedy_and_sampled's program
    np.testing.assert_array_equal(_draws(logits, all_allowed(1, V), 600), _draws(logits, every, 600))


def test_structured_needs_a_tokenizer(tiny_engine):
    sp = SamplingParams(max_tokens=4, structured=canonical_spec({"type": "json_object"}))
    with pytest.raises(JaxsmolError, match="tokenizer"):
        generate(tiny_engine, [1, 2, 3], sp)


# ---- specs and the request mapping (no model) ------------------------------------------------------

def test_canonical_spec_shapes():
    assert canonical_spec(None) is None and canonical_spec({"type": "text"}) is None
    assert json.loads(canonical_spec('{"type": "json_object"}')) == {"type": "json_object"}
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = canonical_spec({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert list(json.loads(spec)["json_schema"]["schema"]["properties"]) == ["b", "a"]  # order kept
    assert canonical_spec({"type": "regex", "regex": "[0-9]+"}) is not None
    assert canonical_spec({"type": "choice", "choice": ["yes", "no"]}) is not None
    assert canonical_spec({"type": "grammar", "grammar": 'start: "a" | "b"'}) is not None
    with pytest.raises(JaxsmolError):
        SamplingParams(structured={"type": "json_object"})  # the field holds canonical text, hashable


@pytest.mark.parametrize("spec, message", [
    ("{not json", "not valid JSON"),
    ([1], "must be an object"),
    ({"type": "xml"}, "type must be one of"),
    ({"type": "json_schema"}, "'schema' object"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}, "invalid schema: Invalid type"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}, "invalid schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}}, "invalid schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"enum": []}}}, "Unsatisfiable"),
    # found by tests/test_fuzz_api.py: llguidance's ValueError for an integer over 64 bits
    ({"type": "json_schema", "json_schema": {"schema": {"maxLength": 2**64}}},
     "invalid schema: .*not JSON serializable"),
    ({"type": "regex", "regex": "[a-"}, "invalid regex"),
    ({"type": "regex"}, "non-empty string"),
    ({"type": "choice", "choice": []}, "non-empty list"),
])
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(JaxsmolError, match=message):
        canonical_spec(spec)


def test_structured_from_request():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    as_schema = canonical_spec({"type": "json_schema", "json_schema": {"name": "guided_json", "schema": schema}})
    assert structured_from_request({}) is None
    assert structured_from_request({"response_format": {"type": "text"}}) is None
    assert structured_from_request({"response_format": {"type": "json_object"}}) == canonical_spec(
        {"type": "json_object"})
    assert structured_from_request({"guided_json": schema}) == as_schema
    assert structured_from_request({"guided_json": json.dumps(schema)}) == as_schema
    assert structured_from_request({"guided_regex": "[0-9]+"}) == canonical_spec({"type": "regex", "regex": "[0-9]+"})
    assert structured_from_request({"guided_choice": ["a", "b"]}) == canonical_spec(
        {"type": "choice", "choice": ["a", "b"]})
    assert structured_from_request({"response_format": {"type": "text"}, "guided_regex": "x"}) is not None


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "x"}, "only one of response_format, guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}}, "response_format: invalid"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_json": "{bad"}, "guided_json is not valid JSON"),
    ({"guided_json": [1]}, "guided_json must be"),
    ({"guided_regex": "("}, "guided_regex: invalid regex"),
    ({"guided_choice": "yes"}, "guided_choice must be"),
])
def test_bad_requests_name_the_field(body, message):
    with pytest.raises(JaxsmolError, match=message):
        structured_from_request(body)


# ---- the real model ---------------------------------------------------------------------------------

def _schema_spec(schema) -> str:
    return canonical_spec({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})


SCHEMAS = {  # (prompt, schema): nested objects, enums, arrays, numbers, required and optional fields
    "nested": ("Describe a person who lives in a city, as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["name", "address"],
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                   "properties": {"city": {"type": "string", "maxLength": 20},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}),
    "enums": ("Pick a T-shirt colour and size, as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["color", "size"],
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}}),
    "arrays": ("List a shopping basket as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["items"],
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False, "required": ["product", "qty"],
            "properties": {"product": {"type": "string", "maxLength": 15},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}}}}),
    "numbers": ("Give the price and weight of an apple, as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["price", "weight_kg", "count"],
        # multipleOf bounds the digits: an unbounded number lets a small model write digits until
        # max_tokens (greedy writes 2.2046212151111... here), which ends with finish_reason "length"
        "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.01},
                       "weight_kg": {"type": "number", "exclusiveMinimum": 0, "maximum": 5, "multipleOf": 0.001},
                       "count": {"type": "integer", "minimum": 0, "maximum": 1000}}}),
    "required": ("Write a to-do item as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["title", "done"],
        "properties": {"title": {"type": "string", "maxLength": 30}, "done": {"type": "boolean"},
                       "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                       "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 10}}}}),
}
MAX_TOKENS = 96  # every schema above bounds its strings and arrays, so outputs finish well within this


def _chat(engine, text):
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def _assert_complete(engine, gen, schema):
    assert gen.finish_reason == "stop", (gen.finish_reason, gen.text)
    assert gen.output_ids[-1] in engine.cfg.eos_ids  # ended by EOS once the value was complete
    value = json.loads(gen.text)
    jsonschema.validate(value, schema)
    return value


SAMPLED = [dict(temperature=1.0, seed=1), dict(temperature=0.8, top_p=0.9, top_k=40, seed=2)]


@pytest.mark.real
@pytest.mark.parametrize("index, name", list(enumerate(SCHEMAS)))
def test_real_schema_output_validates(real_engine, index, name):
    """Greedy and sampled (seeded; plain temperature or with top-k / top-p, alternating by schema)."""
    prompt, schema = SCHEMAS[name]
    ids, spec = _chat(real_engine, prompt), _schema_spec(schema)
    for settings in (dict(), SAMPLED[index % 2]):
        gen = generate(real_engine, ids, SamplingParams(max_tokens=MAX_TOKENS, structured=spec, **settings))
        _assert_complete(real_engine, gen, schema)


@pytest.mark.real
def test_real_open_numbers_and_strings_finish_within_the_default_bounds(real_engine):
    """The "numbers" prompt with its fields left open (plain number, integer, string): greedy wrote
    2.2046212151111... until max_tokens before the default bounds (schema_bounds.py); now it ends."""
    schema = {"type": "object", "additionalProperties": False, "required": ["price", "weight_kg", "count", "unit"],
              "properties": {"price": {"type": "number"}, "weight_kg": {"type": "number"},
                             "count": {"type": "integer"}, "unit": {"type": "string"}}}
    ids, spec = _chat(real_engine, SCHEMAS["numbers"][0]), _schema_spec(schema)
    for settings in (dict(), SAMPLED[0]):
        gen = generate(real_engine, ids, SamplingParams(max_tokens=MAX_TOKENS, structured=spec, **settings))
        value, written = _assert_complete(real_engine, gen, schema), json.loads(gen.text, parse_float=str)
        for key in ("price", "weight_kg"):
            assert abs(value[key]) <= schema_bounds.NUMBER_LIMIT
            assert len(str(written[key]).partition(".")[2]) <= schema_bounds.DECIMALS, gen.text
        assert abs(value["count"]) <= schema_bounds.NUMBER_LIMIT


def test_default_bounds_fill_only_what_a_schema_leaves_open():
    from jaxsmol.runtime.schema_bounds import DECIMALS, NUMBER_LIMIT, STRING_CHARS, bounded

    schema = {"type": "object", "properties": {
        "n": {"type": "number"}, "i": {"type": ["integer", "null"], "minimum": 0},
        "s": {"type": "string"}, "own": {"type": "string", "maxLength": 10**6},
        "re": {"type": "string", "pattern": "a+"},
        "e": {"type": "number", "enum": [1.5, 2.5]}, "list": {"type": "array", "items": {"type": "number"}},
        "either": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/d"}]}, "no": {"not": {"type": "string"}}},
        "$defs": {"d": {"type": "number", "exclusiveMaximum": 1}}}
    out = bounded(schema)["properties"]
    assert out["n"] == {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT,
                        "multipleOf": 10.0**-DECIMALS}
    assert out["i"] == {"type": ["integer", "null"], "minimum": 0, "maximum": NUMBER_LIMIT}
    assert out["s"]["maxLength"] == STRING_CHARS and out["own"]["maxLength"] == 10**6 and "maxLength" not in out["re"]
    assert out["e"] == schema["properties"]["e"] and out["no"] == schema["properties"]["no"]
    assert out["list"]["items"]["maximum"] == NUMBER_LIMIT and out["either"]["anyOf"][0]["maxLength"] == STRING_CHARS
    assert bounded(schema)["$defs"]["d"] == {"type": "number", "exclusiveMaximum": 1, "minimum": -NUMBER_LIMIT,
                                             "multipleOf": 10.0**-DECIMALS}
    assert schema["properties"]["n"] == {"type": "number"}  # the client's schema is not changed


@pytest.mark.real
def test_real_json_object_parses_and_streams(real_engine):
    ids = _chat(real_engine, "Return a JSON object with the keys city and temperature for Paris.")
    for settings in (dict(), dict(temperature=1.0, seed=4)):
        sp = SamplingParams(max_tokens=64, structured=canonical_spec({"type": "json_object"}), **settings)
        steps = []
        gen = generate(real_engine, ids, sp, on_token=steps.append)
        streamed = "".join(step.text for step in steps)
        assert gen.finish_reason == "stop" and streamed == gen.text
        assert isinstance(json.loads(gen.text), dict)


@pytest.mark.real
def test_real_constraint_steps(real_engine):
    tok = real_engine.tokenizer
    spec = _schema_spec({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                         "additionalProperties": False})
    c = constraint_for(tok, real_engine.cfg.eos_ids, real_engine.cfg.vocab_size, spec)
    first = np.flatnonzero(c.allowed())
    assert len(first) > 0 and all(tok.decode([int(i)]).startswith("{") for i in first)
    for t in tok.encode('{"ok": true}'):
        assert c.allowed()[t] and not c.done
        c.advance(t)
    assert c.accepting and c.done
    assert set(np.flatnonzero(c.allowed())) == set(real_engine.cfg.eos_ids)  # only EOS remains
    with pytest.raises(RuntimeError, match="rejected"):
        c.advance(tok.encode("x")[0])


@pytest.mark.real
def test_masks_along_drafts_past_the_end_leave_the_constraint_where_it_was(real_engine):
    """Drafts through the output's end (its last tokens, then end-of-sequence: an earlier answer drafted
    from the cache) give each position's mask and leave the constraint where it was. (The matcher keeps
    no history of an end-of-sequence id: a rollback that counted it undid one token too many, and the
    next sampled token, allowed by the right mask, was rejected.)"""
    tok, eos = real_engine.tokenizer, real_engine.cfg.eos_ids
    spec = _schema_spec({"type": "object", "additionalProperties": False, "required": ["city", "country"],
                         "properties": {"city": {"type": "string", "maxLength": 20},
                                        "country": {"type": "string", "enum": ["France", "Italy", "Spain"]}}})
    c = constraint_for(tok, eos, real_engine.cfg.vocab_size, spec)
    ids = tok.encode('{"city": "Santovia", "country": "Spain"}')
    k = next(k for k in range(len(ids)) if tok.decode(ids[:k]).endswith('"country": "'))
    for t in ids[:k]:
        c.advance(t)
    before = c.bitmask()
    drafts = ids[k:] + [eos[0]]
    masks = unpack_bits(c.masks_along(drafts), real_engine.cfg.vocab_size)
    assert masks.shape[0] == len(drafts) + 1 and all(masks[j, t] for j, t in enumerate(drafts))
    np.testing.assert_array_equal(c.bitmask(), before)
    assert c.allowed()[tok.encode("Italy")[0]]
    for t in drafts:
        c.advance(t)
    assert c.done


def test_a_row_whose_grammar_fails_fails_alone(tiny_model_dir):
    """A structured row whose grammar matcher enters its error state (as llguidance's resource limits put
    it) fails its own request, naming the matcher's error; the free-text request beside it in the same
    batch completes as plain decoding does."""
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.requests import Collector, Request
    from jaxsmol.cache.scheduler.scheduler import Scheduler
    from jaxsmol.runtime.engine import Engine

    engine = Engine.load(tiny_model_dir, ctx=512, progress=False)
    sched = Scheduler(PrefixCache(engine, mode="off"), max_batch=2, speculate="none")
    ids = engine.tokenizer.encode("Answer in JSON:")
    broken, free = Collector(), Collector()

    def break_its_matcher(index, step):  # after its second token, a token its grammar refuses
        if len(broken.steps[index]) == 2:
            row = next(r for r in sched.rows if r is not None and r.request.sink is broken)
            row.constraint._matcher.consume_token(int(np.flatnonzero(~row.constraint.allowed())[0]))
    broken.on_token = break_its_matcher
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    sched.submit(Request(ids, [SamplingParams(max_tokens=12, structured=canonical_spec({"type": "json_object"}))],
                         broken))
    sched.submit(Request(ids, [sp], free))
    sched.run()
    assert len(broken.errors) == 1 and "grammar matcher stopped" in str(broken.errors[0])
    assert not free.errors and free.results[0].output_ids == generate(engine, ids, sp, speculate="none").output_ids


@pytest.mark.real
def test_real_regex_and_choice(real_engine):
    ids = _chat(real_engine, "What is a phone number?")
    gen = generate(real_engine, ids, SamplingParams(max_tokens=16, structured=canonical_spec(
        {"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"})))
    assert gen.finish_reason == "stop" and len(gen.text) == 8 and gen.text[3] == "-"
    assert gen.text.replace("-", "").isdigit()
    ids = _chat(real_engine, "Is the sky blue? Answer yes or no.")
    gen = generate(real_engine, ids, SamplingParams(max_tokens=8, temperature=1.0, seed=3, structured=canonical_spec(
        {"type": "choice", "choice": ["yes", "no", "maybe"]})))
    assert gen.finish_reason == "stop" and gen.text in ("yes", "no", "maybe")


@pytest.mark.real
def test_real_length_cut_is_reported(real_engine):
    """Too few tokens: generation stops at max_tokens with finish_reason 'length' and a prefix of valid JSON."""
    prompt, schema = SCHEMAS["nested"]
    gen = generate(real_engine, _chat(real_engine, prompt),
                               SamplingParams(max_tokens=5, structured=_schema_spec(schema)))
    assert gen.finish_reason == "length" and len(gen.output_ids) == 5 and gen.text.startswith('{"name": ')


@pytest.mark.real
def test_real_prefix_cache_cold_and_warm(real_engine):
    from jaxsmol.cache.prefix_cache import PrefixCache

    prompt, schema = SCHEMAS["enums"]
    ids, spec = _chat(real_engine, prompt), _schema_spec(schema)
    for sp in (SamplingParams(max_tokens=MAX_TOKENS, structured=spec),
               SamplingParams(max_tokens=MAX_TOKENS, structured=spec, temperature=1.0, seed=5)):
        cache = PrefixCache(real_engine)
        cold = generate(cache, ids, sp)
        cold_report = cold.report
        warm = generate(cache, ids, sp)  # an exact full hit: the stored logits, masked
        warm_report = warm.report
        assert cold_report.reused == 0 and warm_report.exact_hit
        for gen in (cold, warm):
            _assert_complete(real_engine, gen, schema)
        assert warm.output_ids == cold.output_ids
    # a prompt that shares only a prefix with the stored one: the restored part, then masked decoding
    other = _chat(real_engine, prompt + " Keep it short.")
    gen = generate(cache, other, SamplingParams(max_tokens=MAX_TOKENS, structured=spec))
    report = gen.report
    assert 0 < report.reused < len(other)
    _assert_complete(real_engine, gen, schema)


# ---- the command line -------------------------------------------------------------------------------

def _cli(*args):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "jaxsmol.cli.main", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.real
def test_cli_json_schema(tmp_path):
    prompt, schema = SCHEMAS["enums"]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    r = _cli("generate", "--chat", prompt, "--json-schema", path, "--max-tokens", 32, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), schema)
    r = _cli("generate", "--chat", "Return a JSON object with the keys city and temperature for Paris.",
             "--json-object", "--max-tokens", 48, "--no-stream")
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout), dict)


def test_cli_bad_schema_is_one_error_line(tmp_path):
    """Refused before the model loads: one `error:` line, exit status 2."""
    bad, broken = tmp_path / "bad.json", tmp_path / "broken.json"
    bad.write_text('{"type": "objectx"}')
    broken.write_text('{"type": ')
    for args, message in [(("--json-schema", bad), "invalid schema: Invalid type"),
                          (("--json-schema", broken), "is not valid JSON"),
                          (("--json-schema", tmp_path / "missing.json"), "cannot read schema file"),
                          (("--regex", "[a-"), "invalid regex"),
                          (("--json-object", "--regex", "a"), "not allowed with")]:
        r = _cli("generate", "hello", *args)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], r.stderr

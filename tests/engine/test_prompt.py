import pytest

from kvmem.engine.prompt import PromptBuilder
from kvmem.errors import InvalidInputError


@pytest.fixture(scope="module")
def builder(tokenizer):
    return PromptBuilder(tokenizer)


def test_segments_are_contiguous_and_hold_the_fact_tokens(builder):
    facts = [("f1", builder.fact_tokens("I like tea.")), ("f2", builder.fact_tokens("My cat is Miso."))]
    prompt = builder.chat(facts, [{"role": "user", "content": "Hi"}])
    end = 0
    for seg in prompt.segments:
        assert seg.start == end
        end = seg.end
    assert prompt.segments[0].fact_id == builder.head_id
    for seg, (_, tokens) in zip(prompt.segments[1:], facts):
        assert prompt.token_ids[seg.start : seg.end] == tokens
    assert end < len(prompt.token_ids)  # the tail (question, generation prompt) follows


def test_prompt_reads_like_the_chat_template(builder, tokenizer):
    prompt = builder.chat([("f1", builder.fact_tokens("I like tea."))], [{"role": "user", "content": "Hi"}])
    system = builder.config.system_prefix + "- I like tea.\n" + builder.config.system_suffix
    expected = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
                                             tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(prompt.token_ids) == expected


def test_encoding_places_the_fact_after_head_and_context(builder):
    fact, ctx = builder.fact_tokens("I like tea."), builder.context_tokens("We spoke about drinks.")
    prompt = builder.encoding("f1", fact, ctx)
    (seg,) = prompt.segments
    assert seg.start == len(builder.head_ids) + len(ctx) and prompt.token_ids[seg.start :] == fact


@pytest.mark.parametrize("bad", ["", "   ", None, 5])
def test_empty_or_non_string_facts_are_refused(builder, bad):
    with pytest.raises(InvalidInputError, match="non-empty string"):
        builder.fact_tokens(bad)


@pytest.mark.parametrize("messages", [[], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 3}]])
def test_bad_messages_are_refused(builder, messages):
    with pytest.raises(InvalidInputError):
        builder.chat([], messages)


def test_facts_tokenized_in_a_batch_match_one_at_a_time(builder):
    texts = ["I like tea.", "My cat is Miso.", "I like tea.", "  Spaces around  ", "Ünïcode façts 🙂"]
    one_by_one = [tuple(builder._tokens(builder.config.fact_template.format(text=t.strip()))) for t in texts]
    assert builder.fact_tokens_many(texts) == one_by_one
    assert builder.fact_tokens_many(texts) == one_by_one  # now from the cache
    assert len(builder._fact_cache) == 4

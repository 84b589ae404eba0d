"""The engine oracle tests of tests/engine/, run again here on vLLM's CUDA backend (the `mem`
fixture starts the real engine on whatever device vLLM finds): k=1 injection equals text
prefill, ten facts encoded after their true prefix equal text prefill, a bad blob falls back
to text, two users never share cached blocks, and selective recompute of every fact token
equals text prefill. Skipped where no CUDA device exists."""

from tests.engine.test_fallback import test_bad_blob_falls_back_to_text  # noqa: F401
from tests.engine.test_injection import (  # noqa: F401
    test_injection_after_a_partial_prefix_cache_hit_stays_exact,
    test_k1_injection_matches_text_prefill,
    test_k10_facts_encoded_after_their_true_prefix_reproduce_text_prefill,
)
from tests.engine.test_recompute import (  # noqa: F401
    facts,
    test_recomputed_blocks_never_serve_another_setting_or_text,
    test_recomputing_every_fact_token_matches_text_prefill,
)
from tests.engine.test_isolation import test_identical_prompts_of_two_users_share_no_blocks  # noqa: F401

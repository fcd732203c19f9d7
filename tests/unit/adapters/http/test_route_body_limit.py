"""The router and the route service agree on size (issue 16, finding 6: a prompt the router
took was above the route service's body limit, so the router fell back and sent a ~2M-token
prompt to an engine). The router refuses prompts over ``router.max_prompt_tokens``; the
biggest route call it can then make must be read and decoded by the route service."""

from __future__ import annotations

import numpy as np

from foretoken.adapters.http.route_page import limits_of
from foretoken.adapters.http.router.routing import Placement
from foretoken.core.types import ModelName, RequestId
from foretoken.settings import load_settings
from foretoken.wire.route_rpc import decode_route_request


def test_the_routers_largest_route_call_fits_the_route_services_limits() -> None:
    s = load_settings(env={})
    n = s.router.max_prompt_tokens
    longest = "x" * 256  # the router's bound on x-request-id and conversation ids
    call = Placement(
        request_id=RequestId(f"{longest}~{2**63}"), client_id=longest,  # a retry's id
        model=ModelName(longest),
        token_ids=np.full(n, 2**32 - 1, dtype=np.uint32),
        max_queue_wait_s=s.router.max_queue_wait_s, already_waited_s=3600.0,
        workload_class=max(s.controls.classes, key=len), prefer_cache_hit=True,
        conversation_id=longest, expected_output_tokens=s.router.max_output_tokens,
        cache_salt=longest,  # the router takes a salt up to 256 characters, as the RPC does
    ).rpc()  # fmt: skip
    assert len(call) <= s.route.body_limit
    assert len(call) <= s.router.max_body_bytes
    decoded = decode_route_request(call, limits_of(s.route))
    assert decoded.prompt_tokens == n and decoded.cache_salt == longest

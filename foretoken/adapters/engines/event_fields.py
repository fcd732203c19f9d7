"""The fields of one engine KV event (vLLM, SGLang), decoded into our records; the
frames and batches around them: :mod:`foretoken.adapters.engines.decoders`.

Events are msgspec tagged unions whose tag is the class name: ``BlockStored``,
    ``BlockRemoved``, ``AllBlocksCleared``. Up to vLLM PR #42892 they were ``array_like``:
    ``[tag, field1, ...]``; msgspec ignores ``omit_defaults`` for arrays (msgspec issue
    #720), so nil fields are written, but older versions have fewer fields, so arrays may
    end early. Since then they are maps ``{"type": tag, field: ...}`` with nil optional
    fields omitted. SGLang followed (PR #37482) with maps; older SGLang sends arrays.
    Other tags (newer vLLM has e.g. ``CacheStoreCommitted``) are skipped and counted.

vLLM ``BlockStored`` field order: block_hashes, parent_block_hash, token_ids, block_size,
    lora_id, medium (PR #19737), lora_name (#27577), extra_keys (#33304, one entry per
    block: a tuple of MM hashes / LoRA name / cache_salt / prompt-embeds hashes, or nil),
    group_idx (#37688), kv_cache_spec_kind and kv_cache_spec_sliding_window (#40984),
    then (map form only) locality (#48281: "LOCAL"/"REMOTE"/nil, on removals too) and
    ownership (#52067: which secondary tier emitted it). Secondary tiers publish media
    ``FS``/``OBJ`` (#47923), later one ``STORAGE`` (#48123): a REMOTE store or removal on
    any lower tier is our SHARED tier, else FS/STORAGE are DISK and OBJ SHARED. Ownership
    is not needed: each tier stores and removes its own copies, and the index counts copies
    per tier, so one tier's removal leaves another's copy credited.
    ``BlockRemoved``: block_hashes, medium, group_idx. ``AllBlocksCleared``: no fields.
    ``TierBlocksCleared`` (config ``tier_scoped_clear_events``): medium, ownership — a
    reset of one tier (a GPU prefix-cache reset publishes it instead of
    ``AllBlocksCleared``), so that tier alone is cleared.
    Kinds (``vllm/v1/kv_cache_interface.py`` ``KVCacheSpecKind``): full_attention,
    mla_attention, sink_full_attention describe a reusable prefix; sliding_window,
    sliding_window_mla, mamba, chunked_local_attention, encoder_only_attention,
    cross_attention, unknown do not (``full_attention=False``). A nil kind (older
    versions) means a full-attention group.
SGLang ``BlockStored`` positions: block_hashes, parent_block_hash, token_ids, block_size,
    lora_id, medium, then (salted stores, ``BlockStoredWithMetadata``) a metadata map
    ``{"cache_salt": ...}``; map form has ``cache_salt`` / ``session_id`` keys. Position 7
    therefore means ``lora_name`` to vLLM and metadata to SGLang, which is why the decoder
    takes an ``engine``. With ``--enable-kv-events-component-types`` (hybrid models) stores
    and removals carry ``component_type`` ("full", "swa", "mamba"; position 7 of a store
    array, before the metadata; position 3 of a removal): only "full" is a prefix. A Mamba
    checkpoint is one root store of the node's *last* page hash (and its removal names that
    hash): applied, it would re-file or remove the full-attention copy of that page, so
    every other component's event is skipped and counted (``other_components``). Tags
    ``BlockStoredWith…`` / ``BlockRemovedWith…`` are read as stores / removals.

Hashes: vLLM ``vllm/v1/core/kv_cache_utils.py`` ``maybe_convert_block_hash`` publishes
    ``int.from_bytes(digest, "big") & (2**64 - 1)`` (the low 8 bytes, big-endian, of the
    digest with the group id stripped by ``get_block_hash``) when
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is 1 (the default; uint64, may exceed int64),
    else the raw digest bytes (32 for sha256, 16 for xxhash). SGLang
    (``python/sglang/srt/mem_cache/utils.py`` ``hash_str_to_int64``) sends the first 8 bytes
    of a SHA-256 chain as a signed int64; early SGLang sent Python's ``hash()`` (also
    signed 64-bit). :func:`foretoken.wire.records.normalize_engine_hash` maps all to uint64.
SGLang stores (``python/sglang/srt/mem_cache/events.py`` ``KVCacheEventRecorder``): one
    event per page (``block_size`` = tokens in that page), consecutive stores of one chain
    merged into one event (hashes and token ids concatenated). With EAGLE the radix keys
    are bigrams and ``token_ids`` holds pairs ``[t_j, t_j+1]``; we keep ``t_j`` (the page's
    own token) so the ids line up with the prompt; the pair's second item is the next
    token, whose dependency the index's EAGLE rule (last matched block not credited)
    already covers.
Offload connectors (vLLM ``offloading_connector.py`` ``take_events``) store with
    ``parent_block_hash`` nil, ``token_ids`` empty and ``block_size`` 0 (or the offload
    block size) on media such as ``CPU``; such stores decode with ``token_ids=()``. They
    carry no ``kv_cache_spec_kind`` even for sliding-window groups; the index ignores a
    kindless store of a group whose GPU stores named it not full attention.

Normalization choices: ``block_size`` nil or 0 becomes ``default_block_size``; a nil
``group_idx`` is 0; a nil ``lora_name`` with a ``lora_id`` becomes ``"lora-id:<id>"`` so LoRA
blocks never alias base-model blocks; ``extra_keys`` is empty when no block has any,
else one compact-JSON string per block (``""`` for nil); SGLang's ``cache_salt`` goes
into the first block's entry (``["<salt>"]``) of a chain that starts at the root, as vLLM
does. Events on a medium we cannot place (not in :data:`TIER_NAMES`) are skipped and
counted. Anything malformed raises :class:`DecodeError`, never another exception — but a
malformed *event* in an otherwise readable batch costs only itself: the batch keeps its other
events and carries the bad one in :attr:`DecodedBatch.bad_events` (ingest dead-letters it with
the reason). Dropping the whole batch for one event would also drop its valid removals, which
leaves stale blocks credited (LMCache, for one, can put chunk hashes where token ids go). A
batch whose every event is malformed raises: that engine's format is not one we read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

import msgspec

from foretoken.core.index.content_hash import salt_key
from foretoken.core.types import EngineBlockHash
from foretoken.wire.codec import DecodeError, normalize_engine_hash
from foretoken.wire.records import AllCleared, BlockRemoved, BlockStored, KvEvent, Tier
from foretoken.wire.route_rpc import pack_token_ids

Engine = Literal["vllm", "sglang"]

TAG_STORED: Final = "BlockStored"
TAG_REMOVED: Final = "BlockRemoved"
TAG_CLEARED: Final = "AllBlocksCleared"
TAG_TIER_CLEARED: Final = "TierBlocksCleared"  # vLLM's tier-scoped reset: one medium
# SGLang's hybrid models tag each event with the cache component it concerns
# (``--enable-kv-events-component-types``): only the full-attention one is a prefix.
FULL_COMPONENTS: Final = frozenset({"full", "full_attention"})
# Tokens are vocabulary ids; SGLang hashes them as 4-byte unsigned ints.
MAX_TOKEN_ID: Final = (1 << 32) - 1

_TIER_GROUPS: Final[dict[Tier, tuple[str, ...]]] = {
    "GPU": ("GPU", "DEVICE"),
    "CPU": ("CPU", "CPU_PINNED", "CPU_TIER1"),
    "DISK": ("CPU_TIER2", "DISK", "NVME", "STORAGE", "FS"),
    "SHARED": ("EXTERNAL", "NETWORK", "REMOTE", "SHARED", "LMCACHE", "OBJ"),
}
# vLLM's secondary tiers tag their events ``locality`` LOCAL or REMOTE (PR #48281; nil:
# unspecified, never inferred): a REMOTE copy of a lower tier is the shared tier's load cost.
REMOTE_LOCALITY: Final = "REMOTE"
# Engine medium names (upper-cased) → our tier.
TIER_NAMES: Final[Mapping[str, Tier]] = {
    name: tier for tier, names in _TIER_GROUPS.items() for name in names
}
FULL_ATTENTION_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention"})

_VLLM_STORED: Final = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
# SGLang shares the first six positions; its seventh is the salted-store metadata map.
_SGLANG_STORED: Final = (*_VLLM_STORED[:6], "metadata")
_SGLANG_COMPONENT_STORED: Final = (*_VLLM_STORED[:6], "component_type", "metadata")
_REMOVED: Final = ("block_hashes", "medium", "group_idx")
_SGLANG_REMOVED: Final = ("block_hashes", "medium", "component_type")
_TIER_CLEARED: Final = ("medium", "ownership")


def tier_of(medium: object) -> Tier | None:
    """Our tier for an engine medium name (nil → GPU); None when the name is unknown."""
    if medium is None:
        return "GPU"
    if not isinstance(medium, str):
        raise DecodeError(f"medium must be a string or nil, got {type(medium).__name__}")
    return TIER_NAMES.get(medium.strip().upper())


def opt_int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DecodeError(f"{what} must be a non-negative int or nil, got {value!r:.40}")
    return value


def _opt_str(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DecodeError(f"{what} must be a string or nil, got {type(value).__name__}")


def _hashes(value: Any, what: str = "block_hashes") -> tuple[EngineBlockHash, ...]:
    if not isinstance(value, list):
        raise DecodeError(f"{what} must be an array, got {type(value).__name__}")
    return tuple(normalize_engine_hash(h) for h in value)


class EventDecoder:
    """Decodes one engine's events, counting what it skips."""

    def __init__(self, engine: Engine, default_block_size: int) -> None:
        self.engine = engine
        self.default_block_size = default_block_size
        self.unknown_tags: dict[str, int] = {}
        self.unknown_media: dict[str, int] = {}
        self.other_components = 0
        self._stored = _SGLANG_STORED if engine == "sglang" else _VLLM_STORED
        self._removed = _SGLANG_REMOVED if engine == "sglang" else _REMOVED

    def decode(self, raw: Any, out: list[KvEvent]) -> None:
        tag, fields = self._tag_and_fields(raw)
        if tag == TAG_STORED:
            stored = self._stored_event(fields)
            if stored is not None:
                out.append(stored)
        elif tag == TAG_REMOVED:
            removed = self._removed_event(fields)
            if removed is not None:
                out.append(removed)
        elif tag == TAG_CLEARED:
            medium = fields.get("medium")
            if medium is None:
                out.append(AllCleared(medium=None))  # vLLM's tag only: every tier
            elif (tier := self._tier(medium)) is not None:
                out.append(AllCleared(medium=tier))
            # an unknown medium is counted and skipped, as in stores and removals: clearing
            # every tier for it would forget blocks the engine still holds
        elif tag == TAG_TIER_CLEARED:
            if (tier := self._tier(_opt_str(fields.get("medium"), "medium"))) is not None:
                out.append(AllCleared(medium=tier))
        else:
            self.unknown_tags[tag] = self.unknown_tags.get(tag, 0) + 1

    def _tag_and_fields(self, raw: Any) -> tuple[str, dict[Any, Any]]:
        if isinstance(raw, list):
            if not raw or not isinstance(raw[0], str):
                raise DecodeError("an event array starts with its tag string")
            tag = _base_tag(raw[0])
            layout: tuple[str, ...] = {TAG_STORED: self._stored, TAG_REMOVED: self._removed,
                      TAG_TIER_CLEARED: _TIER_CLEARED}.get(tag, ())  # fmt: skip
            if layout is _SGLANG_STORED and len(raw) > 7 and isinstance(raw[7], str):
                layout = _SGLANG_COMPONENT_STORED  # a component type before the metadata
            return tag, dict(zip(layout, raw[1:], strict=False))
        if isinstance(raw, dict):
            map_tag = raw.get("type")
            if not isinstance(map_tag, str):
                raise DecodeError("an event map needs a string 'type'")
            return _base_tag(map_tag), raw
        raise DecodeError(f"an event is an array or a map, got {type(raw).__name__}")

    def _tier(self, medium: Any, locality: Any = None) -> Tier | None:
        tier = tier_of(medium)
        if tier is None:
            self.unknown_media[medium] = self.unknown_media.get(medium, 0) + 1
            return None
        locality = _opt_str(locality, "locality")
        if tier != "GPU" and locality is not None and locality.upper() == REMOTE_LOCALITY:
            return "SHARED"
        return tier

    def _group(self, fields: Mapping[Any, Any]) -> int:
        return opt_int(fields.get("group_idx"), "group_idx") or 0

    def _other_component(self, fields: Mapping[Any, Any]) -> bool:
        """Whether the event concerns an SGLang cache component other than full attention
        (a Mamba checkpoint names the last page's hash: applied, it would move that page)."""
        component = _opt_str(fields.get("component_type"), "component_type")
        if component is None or component.lower() in FULL_COMPONENTS:
            return False
        self.other_components += 1
        return True

    def _removed_event(self, fields: Mapping[Any, Any]) -> BlockRemoved | None:
        if "block_hashes" not in fields:
            raise DecodeError("BlockRemoved without block_hashes")
        hashes = _hashes(fields["block_hashes"])
        if self._other_component(fields):
            return None
        group = self._group(fields)
        tier = self._tier(fields.get("medium"), fields.get("locality"))
        if tier is None:
            return None
        return BlockRemoved(block_hashes=hashes, medium=tier, group_idx=group)

    def _stored_event(self, fields: Mapping[Any, Any]) -> BlockStored | None:
        if "block_hashes" not in fields:
            raise DecodeError("BlockStored without block_hashes")
        hashes = _hashes(fields["block_hashes"])
        if self._other_component(fields):
            return None
        parent_raw = fields.get("parent_block_hash")
        parent = None if parent_raw is None else normalize_engine_hash(parent_raw)
        tokens = self._tokens(fields.get("token_ids"))
        block_size = opt_int(fields.get("block_size"), "block_size") or self.default_block_size
        if tokens and len(tokens) != 4 * len(hashes) * block_size:
            raise DecodeError(
                f"{len(tokens) // 4} token ids do not fill {len(hashes)} blocks of {block_size}"
            )
        lora_id = fields.get("lora_id")
        if lora_id is not None and (isinstance(lora_id, bool) or not isinstance(lora_id, int)):
            raise DecodeError(f"lora_id must be an int or nil, got {type(lora_id).__name__}")
        # a map names it (vLLM; SGLang maps since their LoRA namespacing); SGLang's array
        # layouts have no lora_name position, so its position 7 is never read as one
        lora_name = _opt_str(fields.get("lora_name"), "lora_name")
        if lora_name is None and lora_id is not None:
            lora_name = f"lora-id:{lora_id}"
        kind = _opt_str(fields.get("kv_cache_spec_kind"), "kv_cache_spec_kind")
        extra = self._extra_keys(fields, len(hashes), parent is None, lora_name)
        group = self._group(fields)
        tier = self._tier(fields.get("medium"), fields.get("locality"))
        if tier is None:
            return None
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            packed_token_ids=tokens,
            block_size=block_size,
            lora_name=lora_name,
            medium=tier,
            group_idx=group,
            full_attention=kind is None or kind in FULL_ATTENTION_KINDS,
            extra_keys=extra,
        )

    def _tokens(self, value: Any) -> bytes:
        """The ids packed (``BlockStored.packed_token_ids``): the record's consumers and the
        index then read them without a Python int per token."""
        if value is None:
            return b""
        if not isinstance(value, list):
            raise DecodeError(f"token_ids must be an array, got {type(value).__name__}")
        if self.engine == "sglang":
            value = [_bigram_head(t) for t in value]
        try:  # array("I") takes only ints in [0, 2**32), bools aside
            packed: bytes | None = pack_token_ids(value)
        except (TypeError, OverflowError):
            packed = None
        if packed is None or bool in set(map(type, value)):
            bad = next(t for t in value if isinstance(t, bool) or not isinstance(t, int)
                       or not 0 <= t <= MAX_TOKEN_ID)  # fmt: skip
            raise DecodeError(f"token ids are ints in [0, 2**32), got {bad!r:.40}")
        return packed

    def _extra_keys(self, fields: Mapping[Any, Any], blocks: int, root: bool,
                    lora_name: str | None = None) -> tuple[str, ...]:  # fmt: skip
        if self.engine == "sglang":
            salt = fields.get("cache_salt")
            metadata = fields.get("metadata")
            if salt is None and isinstance(metadata, dict):
                salt = metadata.get("cache_salt")
            salt = _opt_str(salt, "cache_salt")
            if salt is None or not root or blocks == 0:
                return ()
            return (salt_key(salt),) + ("",) * (blocks - 1)
        raw = fields.get("extra_keys")
        if raw is None:
            return ()
        if not isinstance(raw, list) or len(raw) != blocks:
            raise DecodeError(f"extra_keys must be an array of {blocks} entries (one per block)")
        if lora_name is not None:  # vLLM keys every block of a LoRA with its name first; the
            # name is in the chain's seed already (so older engines, without extra_keys, and
            # newer ones hash a LoRA's blocks alike, and as a route lookup of the LoRA does)
            raw = [e[1:] or None if isinstance(e, list) and e and e[0] == lora_name else e
                   for e in raw]  # fmt: skip
        if all(entry is None for entry in raw):
            return ()
        return tuple("" if entry is None else _canonical(entry) for entry in raw)


def _base_tag(tag: str) -> str:
    """SGLang's ``BlockStoredWithComponentType`` and kin are stores and removals."""
    for base in (TAG_STORED, TAG_REMOVED):
        if tag.startswith(base + "With"):
            return base
    return tag


def _bigram_head(token: Any) -> Any:
    """SGLang EAGLE pages carry ``[t_j, t_j+1]`` pairs: keep ``t_j``."""
    if isinstance(token, list):
        if len(token) != 2:
            raise DecodeError(f"an EAGLE bigram token has 2 items, got {len(token)}")
        return token[0]
    return token


def _canonical(entry: Any) -> str:
    if not isinstance(entry, list):
        raise DecodeError(f"an extra_keys entry is an array or nil, got {type(entry).__name__}")
    try:
        return msgspec.json.encode(entry).decode()
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise DecodeError(f"extra_keys entry cannot be represented: {exc}") from exc

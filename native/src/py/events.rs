//! KV events from Python (the README's tuples, or the reference's msgspec events), parsed
//! into owned [`Raw`] events that an [`Event`] borrows for `Index::apply`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use super::args::{
    extract_keys, extract_tokens, extract_u64s, opt_string, opt_tier, opt_u64, tier_of, TokenHold,
};
use crate::hash::Tokens;
use crate::index::Event;
use crate::worker::Stored;

pub(super) struct RawStored<'py> {
    hashes: Vec<u64>,
    parent: Option<u64>,
    tokens: Option<TokenHold<'py>>,
    block_size: i64,
    lora_name: Option<String>,
    tier: usize,
    group_idx: i64,
    full_attention: bool,
    mixes: Vec<Option<u64>>,
}

pub(super) enum Raw<'py> {
    Stored(RawStored<'py>),
    Removed {
        hashes: Vec<u64>,
        tier: usize,
        group_idx: i64,
    },
    Cleared(Option<usize>),
    Reset(String, bool),
}

impl Raw<'_> {
    pub(super) fn event(&self) -> Event<'_> {
        match self {
            Raw::Stored(s) => Event::Stored(Stored {
                hashes: &s.hashes,
                parent: s.parent,
                tokens: s
                    .tokens
                    .as_ref()
                    .map_or(Tokens::Ids(&[]), TokenHold::tokens),
                block_size: s.block_size,
                lora_name: s.lora_name.as_deref(),
                tier: s.tier,
                group_idx: s.group_idx,
                full_attention: s.full_attention,
                extra_keys: &s.mixes,
            }),
            Raw::Removed {
                hashes,
                tier,
                group_idx,
            } => Event::Removed {
                hashes,
                tier: *tier,
                group_idx: *group_idx,
            },
            Raw::Cleared(tier) => Event::Cleared { tier: *tier },
            Raw::Reset(reason, approximate) => Event::Reset {
                reason,
                approximate: *approximate,
            },
        }
    }
}

fn tokens_or_empty<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<TokenHold<'py>>> {
    if obj.is_none() {
        return Ok(None);
    }
    extract_tokens(obj).map(Some)
}

/// `("stored", block_hashes, parent, token_ids, block_size[, lora_name, medium, group_idx,
/// full_attention, extra_keys])`, `("removed", block_hashes[, medium, group_idx])`,
/// `("cleared"[, medium])`, `("reset", reason)`.
fn parse_tuple<'py>(t: &Bound<'py, PyTuple>) -> PyResult<Raw<'py>> {
    let n = t.len();
    let kind = t.get_item(0)?;
    let kind = kind.cast::<PyString>()?;
    let need = |k: usize, what: &str| -> PyResult<()> {
        if n < k {
            return Err(PyValueError::new_err(format!(
                "a {what} event tuple needs at least {k} items, got {n}"
            )));
        }
        Ok(())
    };
    match kind.to_str()? {
        "stored" => {
            need(5, "stored")?;
            Ok(Raw::Stored(RawStored {
                hashes: extract_u64s(&t.get_item(1)?)?,
                parent: opt_u64(&t.get_item(2)?)?,
                tokens: tokens_or_empty(&t.get_item(3)?)?,
                block_size: t.get_item(4)?.extract()?,
                lora_name: if n > 5 {
                    opt_string(&t.get_item(5)?)?
                } else {
                    None
                },
                tier: if n > 6 { tier_of(&t.get_item(6)?)? } else { 0 },
                group_idx: if n > 7 { t.get_item(7)?.extract()? } else { 0 },
                full_attention: if n > 8 {
                    t.get_item(8)?.extract()?
                } else {
                    true
                },
                mixes: if n > 9 {
                    extract_keys(Some(&t.get_item(9)?))?
                } else {
                    Vec::new()
                },
            }))
        }
        "removed" => {
            need(2, "removed")?;
            Ok(Raw::Removed {
                hashes: extract_u64s(&t.get_item(1)?)?,
                tier: if n > 2 { tier_of(&t.get_item(2)?)? } else { 0 },
                group_idx: if n > 3 { t.get_item(3)?.extract()? } else { 0 },
            })
        }
        "cleared" => Ok(Raw::Cleared(if n > 1 {
            opt_tier(&t.get_item(1)?)?
        } else {
            None
        })),
        "reset" => {
            need(2, "reset")?;
            Ok(Raw::Reset(
                t.get_item(1)?.cast::<PyString>()?.to_str()?.to_owned(),
                if n > 2 {
                    t.get_item(2)?.extract()?
                } else {
                    true
                },
            ))
        }
        other => Err(PyValueError::new_err(format!(
            "unknown event kind {other:?} (stored, removed, cleared, reset)"
        ))),
    }
}

/// The reference's msgspec events (`BlockStored`, `BlockRemoved`, `AllCleared`,
/// `IndexReset`), read by attribute.
fn parse_struct<'py>(ev: &Bound<'py, PyAny>) -> PyResult<Raw<'py>> {
    let py = ev.py();
    let name = ev.get_type().name()?;
    match name.to_str()? {
        "BlockStored" => {
            // the packed ids when the event has them (what ingest writes), else the ints
            let mut tokens = ev.getattr(intern!(py, "token_ids"))?;
            if let Ok(packed) = ev.getattr(intern!(py, "packed_token_ids")) {
                if packed
                    .cast::<PyBytes>()
                    .is_ok_and(|b| !b.as_bytes().is_empty())
                {
                    tokens = packed;
                }
            }
            Ok(Raw::Stored(RawStored {
                hashes: extract_u64s(&ev.getattr(intern!(py, "block_hashes"))?)?,
                parent: opt_u64(&ev.getattr(intern!(py, "parent_block_hash"))?)?,
                tokens: tokens_or_empty(&tokens)?,
                block_size: ev.getattr(intern!(py, "block_size"))?.extract()?,
                lora_name: opt_string(&ev.getattr(intern!(py, "lora_name"))?)?,
                tier: tier_of(&ev.getattr(intern!(py, "medium"))?)?,
                group_idx: ev.getattr(intern!(py, "group_idx"))?.extract()?,
                full_attention: ev.getattr(intern!(py, "full_attention"))?.extract()?,
                mixes: extract_keys(Some(&ev.getattr(intern!(py, "extra_keys"))?))?,
            }))
        }
        "BlockRemoved" => Ok(Raw::Removed {
            hashes: extract_u64s(&ev.getattr(intern!(py, "block_hashes"))?)?,
            tier: tier_of(&ev.getattr(intern!(py, "medium"))?)?,
            group_idx: ev.getattr(intern!(py, "group_idx"))?.extract()?,
        }),
        "AllCleared" => Ok(Raw::Cleared(opt_tier(&ev.getattr(intern!(py, "medium"))?)?)),
        "IndexReset" => Ok(Raw::Reset(
            ev.getattr(intern!(py, "reason"))?
                .cast::<PyString>()?
                .to_str()?
                .to_owned(),
            ev.getattr(intern!(py, "approximate"))?.extract()?,
        )),
        other => Err(PyTypeError::new_err(format!("not a KV event: {other}"))),
    }
}

pub(super) fn parse_events<'py>(events: &Bound<'py, PyAny>) -> PyResult<Vec<Raw<'py>>> {
    let parse = |item: Bound<'py, PyAny>| -> PyResult<Raw<'py>> {
        match item.cast::<PyTuple>() {
            Ok(t) => parse_tuple(t),
            Err(_) => parse_struct(&item),
        }
    };
    if let Ok(list) = events.cast::<PyList>() {
        return list.iter().map(parse).collect();
    }
    if let Ok(tuple) = events.cast::<PyTuple>() {
        return tuple.iter().map(parse).collect();
    }
    events.try_iter()?.map(|item| parse(item?)).collect()
}

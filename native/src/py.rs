//! The Python module `foretoken_native` (PyO3): the hash functions and `NativeIndex`.
//!
//! Inputs: token ids as packed bytes (u32 little-endian, what the router sends), any
//! buffer of u32/i32/i64/u64 (numpy arrays, `array.array`), or a sequence of ints (slow
//! path). Block hashes as bytes (u64 little-endian), a u64/i64 buffer, or ints. Everything
//! is converted before the index changes, so a malformed batch raises and changes nothing.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyString, PyTuple};

use crate::hash::{self, Tokens};
use crate::index::{Event, Hit, Index};
use crate::queue::{self, Cost, Kv, Scheduler, Seq, Stretch};
use crate::snapshot;
use crate::space::{tier_index, TIERS};
use crate::stats::ApplyStats;
use crate::worker::{RecentPolicy, Stored};

// --------------------------------------------------------------------------- inputs

/// Token ids held for the duration of a call: borrowed from a `bytes` object, or converted.
enum TokenHold<'py> {
    Packed(Bound<'py, PyBytes>),
    Bytes(Vec<u8>),
    Ids(Vec<u32>),
}

impl TokenHold<'_> {
    fn tokens(&self) -> Tokens<'_> {
        match self {
            TokenHold::Packed(b) => Tokens::Packed(b.as_bytes()),
            TokenHold::Bytes(b) => Tokens::Packed(b),
            TokenHold::Ids(ids) => Tokens::Ids(ids),
        }
    }
}

fn packed_len_ok(len: usize) -> PyResult<()> {
    if len % 4 != 0 {
        return Err(PyValueError::new_err(format!(
            "packed token ids must be u32 little-endian (a multiple of 4 bytes), got {len} bytes"
        )));
    }
    Ok(())
}

fn token_id(value: i64) -> PyResult<u32> {
    u32::try_from(value)
        .map_err(|_| PyValueError::new_err(format!("token id {value} is outside 0..2^32")))
}

fn ids_from_iter<'py>(
    items: impl Iterator<Item = PyResult<Bound<'py, PyAny>>>,
) -> PyResult<Vec<u32>> {
    let mut out = Vec::with_capacity(items.size_hint().0);
    for item in items {
        out.push(token_id(item?.extract::<i64>()?)?);
    }
    Ok(out)
}

fn extract_tokens<'py>(obj: &Bound<'py, PyAny>) -> PyResult<TokenHold<'py>> {
    if let Ok(bytes) = obj.cast::<PyBytes>() {
        packed_len_ok(bytes.as_bytes().len())?;
        return Ok(TokenHold::Packed(bytes.clone()));
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return Ok(TokenHold::Ids(ids_from_iter(tuple.iter().map(Ok))?));
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return Ok(TokenHold::Ids(ids_from_iter(list.iter().map(Ok))?));
    }
    if let Ok(buffer) = PyUntypedBuffer::get(obj) {
        let py = obj.py();
        return match buffer.item_size() {
            1 => {
                let bytes = buffer.into_typed::<u8>()?.to_vec(py)?;
                packed_len_ok(bytes.len())?;
                Ok(TokenHold::Bytes(bytes))
            }
            4 if buffer.format().to_bytes().ends_with(b"i") => {
                let ids = buffer.into_typed::<i32>()?.to_vec(py)?;
                let ids: PyResult<Vec<u32>> = ids.into_iter().map(|v| token_id(v.into())).collect();
                Ok(TokenHold::Ids(ids?))
            }
            4 => Ok(TokenHold::Ids(buffer.into_typed::<u32>()?.to_vec(py)?)),
            8 if buffer.format().to_bytes().ends_with(b"Q")
                || buffer.format().to_bytes().ends_with(b"L") =>
            {
                let ids = buffer.into_typed::<u64>()?.to_vec(py)?;
                let ids: PyResult<Vec<u32>> = ids
                    .into_iter()
                    .map(|v| token_id(i64::try_from(v).unwrap_or(-1)))
                    .collect();
                Ok(TokenHold::Ids(ids?))
            }
            8 => {
                let ids = buffer.into_typed::<i64>()?.to_vec(py)?;
                let ids: PyResult<Vec<u32>> = ids.into_iter().map(token_id).collect();
                Ok(TokenHold::Ids(ids?))
            }
            n => Err(PyTypeError::new_err(format!(
                "token ids: a buffer of {n}-byte items is not supported (use uint32 or int64)"
            ))),
        };
    }
    match obj.try_iter() {
        Ok(iter) => Ok(TokenHold::Ids(ids_from_iter(iter)?)),
        Err(_) => Err(PyTypeError::new_err(
            "token ids must be packed bytes (u32 LE), a numpy/buffer array or a sequence of ints",
        )),
    }
}

fn u64s_from_iter<'py>(
    items: impl Iterator<Item = PyResult<Bound<'py, PyAny>>>,
) -> PyResult<Vec<u64>> {
    let mut out = Vec::with_capacity(items.size_hint().0);
    for item in items {
        out.push(item?.extract::<u64>()?);
    }
    Ok(out)
}

/// Block hashes (engine or own): bytes of u64 LE, a u64/i64 buffer, or a sequence of ints.
fn extract_u64s(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(bytes) = obj.cast::<PyBytes>() {
        let data = bytes.as_bytes();
        if data.len() % 8 != 0 {
            return Err(PyValueError::new_err(format!(
                "packed hashes must be u64 little-endian (a multiple of 8 bytes), got {} bytes",
                data.len()
            )));
        }
        return Ok(data
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect());
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return u64s_from_iter(tuple.iter().map(Ok));
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return u64s_from_iter(list.iter().map(Ok));
    }
    if let Ok(buffer) = PyUntypedBuffer::get(obj) {
        let py = obj.py();
        if buffer.item_size() == 8 {
            let format = buffer.format().to_bytes();
            if format.ends_with(b"Q") || format.ends_with(b"L") {
                return buffer.into_typed::<u64>()?.to_vec(py);
            }
            // like numpy's astype(uint64): two's complement
            let values = buffer.into_typed::<i64>()?.to_vec(py)?;
            return Ok(values.into_iter().map(|v| v as u64).collect());
        }
        return Err(PyTypeError::new_err(
            "hashes: a buffer must hold 8-byte integers",
        ));
    }
    match obj.try_iter() {
        Ok(iter) => u64s_from_iter(iter),
        Err(_) => Err(PyTypeError::new_err(
            "hashes must be bytes (u64 LE), a uint64 array or a sequence of ints",
        )),
    }
}

fn extract_keys(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Option<u64>>> {
    let Some(obj) = obj else {
        return Ok(Vec::new());
    };
    if obj.is_none() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for item in obj.try_iter()? {
        let item = item?;
        let key = item.cast::<PyString>()?.to_str()?;
        out.push((!key.is_empty()).then(|| hash::extra_key_mix(key)));
    }
    Ok(out)
}

fn tier(name: &str) -> PyResult<usize> {
    tier_index(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown medium {name:?}, expected one of {TIERS:?}"
        ))
    })
}

/// A medium name given as a Python str.
fn tier_of(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    tier(obj.cast::<PyString>()?.to_str()?)
}

fn opt_tier(obj: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    if obj.is_none() {
        return Ok(None);
    }
    Ok(Some(tier_of(obj)?))
}

fn opt_string(obj: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    if obj.is_none() {
        return Ok(None);
    }
    Ok(Some(obj.cast::<PyString>()?.to_str()?.to_owned()))
}

fn opt_u64(obj: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    if obj.is_none() {
        return Ok(None);
    }
    Ok(Some(obj.extract::<u64>()?))
}

// --------------------------------------------------------------------------- events

struct RawStored<'py> {
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

enum Raw<'py> {
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
    fn event(&self) -> Event<'_> {
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
            let tokens = ev.getattr(intern!(py, "token_ids"))?;
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

fn parse_events<'py>(events: &Bound<'py, PyAny>) -> PyResult<Vec<Raw<'py>>> {
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

// --------------------------------------------------------------------------- outputs

static FROMBUFFER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// A writable numpy uint64 array (little-endian) of the hashes.
fn u64_array<'py>(py: Python<'py>, values: &[u64]) -> PyResult<Bound<'py, PyAny>> {
    let buffer = PyByteArray::new_with(py, values.len() * 8, |buf| {
        for (dst, v) in buf.chunks_exact_mut(8).zip(values) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    })?;
    let frombuffer = FROMBUFFER.import(py, "numpy", "frombuffer")?;
    frombuffer.call1((buffer, intern!(py, "<u8")))
}

fn u64_bytes<'py>(py: Python<'py>, values: &[u64]) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, values.len() * 8, |buf| {
        for (dst, v) in buf.chunks_exact_mut(8).zip(values) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    })
}

fn stats_tuple<'py>(py: Python<'py>, stats: &ApplyStats) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, stats.values())
}

fn stats_dict<'py>(py: Python<'py>, stats: &ApplyStats) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (name, value) in ApplyStats::FIELDS.iter().zip(stats.values()) {
        dict.set_item(name, value)?;
    }
    Ok(dict)
}

/// `{tier name: count}` for a per-tier array (GPU, CPU, DISK, SHARED).
fn per_tier<'py, T: IntoPyObject<'py>>(
    py: Python<'py>,
    counts: [T; 4],
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (tier, n) in TIERS.iter().zip(counts) {
        dict.set_item(tier, n)?;
    }
    Ok(dict)
}

fn hit_tuple<'py>(py: Python<'py>, hit: &Hit) -> PyResult<Bound<'py, PyAny>> {
    let [gpu, cpu, disk, shared] = hit.tiers;
    Ok((
        hit.block_size,
        hit.tokens,
        gpu,
        cpu,
        disk,
        shared,
        hit.approximate,
    )
        .into_pyobject(py)?
        .into_any())
}

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

// --------------------------------------------------------------------------- module functions

/// The chain's starting value for one (salt, model, block size, LoRA adapter), spec v2.
#[pyfunction]
#[pyo3(signature = (salt, model, block_size, lora_name=None))]
fn root_seed(salt: &[u8], model: &str, block_size: i64, lora_name: Option<&str>) -> u64 {
    hash::root_seed(salt, model, block_size, lora_name)
}

/// A block's extra key as a u64 (0 for "").
#[pyfunction]
fn extra_key_mix(key: &str) -> u64 {
    hash::extra_key_mix(key)
}

fn chain_values(
    seed: u64,
    token_ids: &Bound<'_, PyAny>,
    block_size: usize,
    extra_keys: Option<&Bound<'_, PyAny>>,
    max_blocks: Option<usize>,
) -> PyResult<Vec<u64>> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be >= 1"));
    }
    let tokens = extract_tokens(token_ids)?;
    let mixes = extract_keys(extra_keys)?;
    Ok(hash::chain(
        seed,
        tokens.tokens(),
        block_size,
        &mixes,
        max_blocks,
    ))
}

/// Own hashes of the full blocks of `token_ids` chained from `seed`, as a uint64 array.
#[pyfunction]
#[pyo3(signature = (seed, token_ids, block_size, extra_keys=None, max_blocks=None))]
fn chain<'py>(
    py: Python<'py>,
    seed: u64,
    token_ids: &Bound<'py, PyAny>,
    block_size: usize,
    extra_keys: Option<&Bound<'py, PyAny>>,
    max_blocks: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let owns = chain_values(seed, token_ids, block_size, extra_keys, max_blocks)?;
    u64_array(py, &owns)
}

/// Like `chain`, as bytes (u64 little-endian): the cheapest output.
#[pyfunction]
#[pyo3(signature = (seed, token_ids, block_size, extra_keys=None, max_blocks=None))]
fn chain_bytes<'py>(
    py: Python<'py>,
    seed: u64,
    token_ids: &Bound<'py, PyAny>,
    block_size: usize,
    extra_keys: Option<&Bound<'py, PyAny>>,
    max_blocks: Option<usize>,
) -> PyResult<Bound<'py, PyBytes>> {
    let owns = chain_values(seed, token_ids, block_size, extra_keys, max_blocks)?;
    u64_bytes(py, &owns)
}

// --------------------------------------------------------------------------- NativeIndex

/// The multi-tier prefix index (see the crate's README for the API and its semantics).
#[pyclass(module = "foretoken_native", name = "NativeIndex")]
pub struct NativeIndex {
    core: Index,
}

#[pymethods]
impl NativeIndex {
    #[new]
    #[pyo3(signature = (*, salt=b"".as_slice(), recent_min_blocks=4096, recent_peak_factor=0.125))]
    fn new(salt: &[u8], recent_min_blocks: u64, recent_peak_factor: f64) -> PyResult<Self> {
        if !recent_peak_factor.is_finite() || recent_peak_factor < 0.0 {
            return Err(PyValueError::new_err(
                "recent_peak_factor must be finite and >= 0",
            ));
        }
        let policy = RecentPolicy {
            min_blocks: recent_min_blocks,
            peak_factor: recent_peak_factor,
        };
        Ok(Self {
            core: Index::new(salt, policy),
        })
    }

    #[getter]
    fn salt<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.core.salt())
    }

    #[pyo3(signature = (worker_id, model, block_size, *, eagle=false, store_only_ttl_s=None, capacity_blocks=None))]
    fn register_worker(
        &mut self,
        worker_id: &str,
        model: &str,
        block_size: i64,
        eagle: bool,
        store_only_ttl_s: Option<f64>,
        capacity_blocks: Option<i64>,
    ) -> PyResult<()> {
        self.core
            .register_worker(
                worker_id,
                model,
                block_size,
                eagle,
                store_only_ttl_s,
                capacity_blocks,
            )
            .map_err(value_error)
    }

    fn remove_worker(&mut self, worker_id: &str) {
        self.core.remove_worker(worker_id);
    }

    fn reset_worker(&mut self, worker_id: &str, reason: &str) {
        self.core.reset_worker(worker_id, reason);
    }

    /// Applies one batch of event tuples (see the README); returns the call's counters as a
    /// tuple in the order of `APPLY_STATS_FIELDS`.
    #[pyo3(signature = (worker_id, model, seq, dp_rank, events, now_s))]
    #[allow(clippy::too_many_arguments)]
    fn apply_batch<'py>(
        &mut self,
        py: Python<'py>,
        worker_id: &str,
        model: &str,
        seq: i64,
        dp_rank: i64,
        events: &Bound<'py, PyAny>,
        now_s: f64,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let raw = parse_events(events)?;
        let events: Vec<Event<'_>> = raw.iter().map(Raw::event).collect();
        let stats = self
            .core
            .apply(worker_id, model, seq, dp_rank, &events, now_s);
        stats_tuple(py, &stats)
    }

    /// Applies one `KvEventBatch` of the reference's records (attributes `worker_id`,
    /// `model`, `seq`, `dp_rank`, `events`); returns the counters like `apply_batch`.
    fn apply<'py>(
        &mut self,
        py: Python<'py>,
        batch: &Bound<'py, PyAny>,
        now_s: f64,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let worker_id = batch.getattr(intern!(py, "worker_id"))?;
        let model = batch.getattr(intern!(py, "model"))?;
        let seq: i64 = batch.getattr(intern!(py, "seq"))?.extract()?;
        let dp_rank: i64 = batch.getattr(intern!(py, "dp_rank"))?.extract()?;
        let raw = parse_events(&batch.getattr(intern!(py, "events"))?)?;
        let events: Vec<Event<'_>> = raw.iter().map(Raw::event).collect();
        let stats = self.core.apply(
            worker_id.cast::<PyString>()?.to_str()?,
            model.cast::<PyString>()?.to_str()?,
            seq,
            dp_rank,
            &events,
            now_s,
        );
        stats_tuple(py, &stats)
    }

    fn observe_served(
        &mut self,
        worker_id: &str,
        own_hashes: &Bound<'_, PyAny>,
        now_s: f64,
    ) -> PyResult<usize> {
        if !self.core.has_worker(worker_id) {
            return Ok(0);
        }
        let owns = extract_u64s(own_hashes)?;
        Ok(self.core.observe_served(worker_id, &owns, now_s))
    }

    fn age(&mut self, now_s: f64) {
        self.core.age(now_s);
    }

    fn maintain<'py>(&mut self, py: Python<'py>, now_s: f64) -> PyResult<Bound<'py, PyTuple>> {
        let stats = self.core.maintain(now_s);
        stats_tuple(py, &stats)
    }

    /// Own hashes (numpy uint64) of the prompt's full blocks in the (model, block size) space.
    #[pyo3(signature = (model, block_size, token_ids, *, lora_name=None, extra_keys=None))]
    fn hash_prompt<'py>(
        &self,
        py: Python<'py>,
        model: &str,
        block_size: usize,
        token_ids: &Bound<'py, PyAny>,
        lora_name: Option<&str>,
        extra_keys: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block_size must be >= 1"));
        }
        let tokens = extract_tokens(token_ids)?;
        let mixes = extract_keys(extra_keys)?;
        let owns = self
            .core
            .hash_prompt(model, block_size, tokens.tokens(), lora_name, &mixes);
        u64_array(py, &owns)
    }

    /// `{worker_id: (block_size, tokens, gpu_tokens, cpu_tokens, disk_tokens, shared_tokens,
    /// approximate)}` for every worker of the model (the fields of the reference's CacheHit,
    /// in its order).
    #[pyo3(signature = (model, token_ids=None, *, own_hashes=None, lora_name=None, extra_keys=None, now_s=None))]
    #[allow(clippy::too_many_arguments)]
    fn lookup<'py>(
        &mut self,
        py: Python<'py>,
        model: &str,
        token_ids: Option<&Bound<'py, PyAny>>,
        own_hashes: Option<&Bound<'py, PyAny>>,
        lora_name: Option<&str>,
        extra_keys: Option<&Bound<'py, PyAny>>,
        now_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let tokens = match token_ids {
            Some(obj) if !obj.is_none() => Some(extract_tokens(obj)?),
            _ => None,
        };
        let mut given: Vec<(u32, Vec<u64>)> = Vec::new();
        if let Some(mapping) = own_hashes.filter(|m| !m.is_none()) {
            for size in self.core.block_sizes(model) {
                let value = mapping.call_method1(intern!(py, "get"), (size,))?;
                if !value.is_none() {
                    given.push((size, extract_u64s(&value)?));
                }
            }
        }
        let given: Vec<(u32, &[u64])> = given.iter().map(|(s, h)| (*s, h.as_slice())).collect();
        let mixes = extract_keys(extra_keys)?;
        let hits = self.core.lookup(
            model,
            tokens.as_ref().map(TokenHold::tokens),
            &given,
            lora_name,
            &mixes,
            now_s,
        );
        let out = PyDict::new(py);
        for (worker_id, hit) in hits {
            out.set_item(worker_id, hit_tuple(py, &hit)?)?;
        }
        Ok(out)
    }

    /// Blocks per tier per worker, resets and counters (the keys of the reference's stats()).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let workers = PyDict::new(py);
        for w in self.core.worker_stats() {
            let d = PyDict::new(py);
            d.set_item("model", &w.model)?;
            d.set_item("block_size", w.block_size)?;
            d.set_item("eagle", w.eagle)?;
            d.set_item("store_only", w.store_only)?;
            d.set_item("approximate", w.approximate)?;
            d.set_item("resets", w.resets)?;
            d.set_item("last_reset_reason", &w.last_reset_reason)?;
            let seqs = PyDict::new(py);
            for (rank, seq) in &w.last_seq {
                seqs.set_item(rank, seq)?;
            }
            d.set_item("last_seq", seqs)?;
            d.set_item("blocks", per_tier(py, w.blocks)?)?;
            d.set_item("engine_hashes", w.engine_hashes)?;
            d.set_item("duplicate_copies", w.duplicate_copies)?;
            d.set_item("recently_removed", w.recently_removed)?;
            workers.set_item(&w.worker_id, d)?;
        }
        let spaces = PyList::empty(py);
        for s in self.core.space_stats() {
            let d = PyDict::new(py);
            d.set_item("model", &s.model)?;
            d.set_item("block_size", s.block_size)?;
            d.set_item("workers", s.workers)?;
            d.set_item("entries", per_tier(py, s.entries)?)?;
            spaces.append(d)?;
        }
        let out = PyDict::new(py);
        out.set_item("workers", workers)?;
        out.set_item("spaces", spaces)?;
        out.set_item("counters", stats_dict(py, &self.core.totals())?)?;
        Ok(out)
    }

    /// Everything apply / maintain / reset_worker / observe_served did since the start, by
    /// the names of the reference's ApplyStats.
    #[getter]
    fn totals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.core.totals())
    }

    /// What the native index does beyond the reference: the cross-tier rule's counters and,
    /// per worker, the recently removed blocks it remembers.
    fn native_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let totals = self.core.totals();
        let counters = PyDict::new(py);
        counters.set_item("recovered_parents", totals.recovered_parents)?;
        counters.set_item("recovered_moves", totals.recovered_moves)?;
        let workers = PyDict::new(py);
        let capacity = PyDict::new(py);
        let peaks = PyDict::new(py);
        for w in self.core.worker_stats() {
            workers.set_item(&w.worker_id, w.recently_removed)?;
            capacity.set_item(&w.worker_id, w.recent_capacity)?;
            peaks.set_item(&w.worker_id, w.peak_engine_hashes)?;
        }
        let (tables, maps, recent) = self.core.heap_bytes();
        let heap = PyDict::new(py);
        heap.set_item("mask_tables", tables)?;
        heap.set_item("worker_maps", maps)?;
        heap.set_item("recently_removed", recent)?;
        let out = PyDict::new(py);
        out.set_item("counters", counters)?;
        out.set_item("recently_removed", workers)?;
        out.set_item("recent_capacity", capacity)?;
        out.set_item("peak_engine_hashes", peaks)?;
        out.set_item("heap_bytes_estimate", heap)?;
        Ok(out)
    }

    /// The registered workers, in registration order.
    fn worker_ids(&self) -> Vec<String> {
        self.core.worker_ids()
    }

    /// Per data-parallel rank, the seq of the last batch applied.
    fn last_seq<'py>(&self, py: Python<'py>, worker_id: &str) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (rank, seq) in self.core.last_seq(worker_id) {
            out.set_item(rank, seq)?;
        }
        Ok(out)
    }

    /// The whole state as bytes (versioned header, checksum); `restore` gives back an equal
    /// index.
    fn snapshot<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &snapshot::snapshot(&self.core))
    }

    #[staticmethod]
    fn restore(data: &Bound<'_, PyAny>) -> PyResult<Self> {
        let owned;
        let bytes: &[u8] = if let Ok(b) = data.cast::<PyBytes>() {
            b.as_bytes()
        } else if let Ok(b) = data.cast::<PyByteArray>() {
            owned = b.to_vec();
            &owned
        } else {
            return Err(PyTypeError::new_err("restore() takes bytes"));
        };
        let core = snapshot::restore(bytes).map_err(value_error)?;
        Ok(Self { core })
    }
}

// --------------------------------------------------------------------------- QueueFuture

type SettingsArg = (i64, i64, bool, i64);
type CostArg = (f64, f64, f64, f64);
type KvArg = Option<(i64, i64)>;
type StretchArg = (f64, i64, f64, Vec<(i64, i64)>, i64, i64, i64, i64);

fn queue_settings((budget, max_seqs, chunked, cap): SettingsArg) -> queue::Settings {
    queue::Settings {
        budget,
        max_seqs,
        chunked,
        cap,
    }
}

fn queue_cost((a, b, overhead_s, per_seq_s): CostArg) -> Cost {
    Cost {
        a,
        b,
        overhead_s,
        per_seq_s,
    }
}

fn queue_kv(kv: KvArg) -> PyResult<Option<Kv>> {
    match kv {
        None => Ok(None),
        Some((gpu_blocks, block_size)) if gpu_blocks >= 1 && block_size >= 1 => Ok(Some(Kv {
            gpu_blocks,
            block_size,
        })),
        Some(_) => Err(PyValueError::new_err(
            "kv = (gpu_blocks, block_size), both >= 1",
        )),
    }
}

/// A worker's recorded future (the Python reference's `Future`, see `queue.rs`):
/// `settings` = (max_num_batched_tokens, max_num_seqs, chunked_prefill,
/// long_prefill_token_threshold), `cost` = (a, b, step overhead s, decode s per sequence)
/// of `C(N) = N·(a + b·N)`, `kv` = (gpu_blocks, block_size) of the engine's KV model or
/// None.
#[pyclass(module = "foretoken_native", name = "QueueFuture", frozen)]
pub struct QueueFuture {
    future: queue::Future,
}

#[pymethods]
impl QueueFuture {
    /// Replays a queue to its end: `prefilling` = [(computed, end, output tokens left,
    /// order, kv blocks)] in admission order, `decoders` = [(order, step of its last
    /// token, kv blocks)] in admission order, `waiting` = [(computed, end, output tokens
    /// left, kv blocks)] in arrival order, `kv_used` the blocks the running ones reserve.
    #[staticmethod]
    #[pyo3(signature = (settings, cost, kv, free_at_s, steps, next_order, prefilling, decoders, waiting, now_s, tokens_ahead, kv_used))]
    #[allow(clippy::too_many_arguments)]
    fn record(
        settings: SettingsArg,
        cost: CostArg,
        kv: KvArg,
        free_at_s: f64,
        steps: i64,
        next_order: i64,
        prefilling: Vec<(i64, i64, i64, i64, i64)>,
        decoders: Vec<(i64, i64, i64)>,
        waiting: Vec<(i64, i64, i64, i64)>,
        now_s: f64,
        tokens_ahead: i64,
        kv_used: i64,
    ) -> PyResult<Self> {
        let settings = queue_settings(settings);
        if settings.budget < 1 {
            return Err(PyValueError::new_err("max_num_batched_tokens must be >= 1"));
        }
        let kv = queue_kv(kv)?;
        let scheduler = Scheduler {
            settings,
            prefilling: prefilling
                .into_iter()
                .map(|(computed, end, left, order, blocks)| Seq {
                    computed,
                    end,
                    left,
                    order,
                    blocks,
                })
                .collect(),
            dec_orders: decoders.iter().map(|d| d.0).collect(),
            dec_done: decoders.iter().map(|d| d.1).collect(),
            dec_blocks: decoders.iter().map(|d| d.2).collect(),
            waiting: waiting
                .into_iter()
                .map(|(computed, end, left, blocks)| Seq {
                    computed,
                    end,
                    left,
                    order: -1,
                    blocks,
                })
                .collect(),
            free_at_s,
            steps,
            next_order,
            kv_cap: kv.map_or(0, |k| k.gpu_blocks),
            kv_used,
        };
        let future = queue::Future::record(scheduler, now_s, queue_cost(cost), kv, tokens_ahead)
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
        Ok(Self { future })
    }

    /// A future from recorded stretches [(start_s, steps, per_step_s, chunks, budget_left,
    /// running, waiting, kv_used)] (e.g. the Python reference's).
    #[staticmethod]
    #[pyo3(signature = (settings, cost, kv, ready_s, start_s, stretches, end_s, drained_s, tokens_ahead))]
    #[allow(clippy::too_many_arguments)]
    fn from_stretches(
        settings: SettingsArg,
        cost: CostArg,
        kv: KvArg,
        ready_s: f64,
        start_s: f64,
        stretches: Vec<StretchArg>,
        end_s: f64,
        drained_s: Option<f64>,
        tokens_ahead: i64,
    ) -> PyResult<Self> {
        let stretches = stretches
            .into_iter()
            .map(
                |(start_s, steps, per_step_s, chunks, budget_left, running, waiting, kv_used)| {
                    Stretch {
                        start_s,
                        steps,
                        per_step_s,
                        chunks,
                        budget_left,
                        running,
                        waiting,
                        kv_used,
                    }
                },
            )
            .collect();
        Ok(Self {
            future: queue::Future {
                settings: queue_settings(settings),
                cost: queue_cost(cost),
                kv: queue_kv(kv)?,
                ready_s,
                start_s,
                stretches,
                end_s,
                drained_s,
                tokens_ahead,
            },
        })
    }

    /// `(queue_wait_s, prefill_s, ttft_s, steps, queue_tokens_ahead)` of a new request
    /// arriving at `now_s` behind the queue.
    fn first_token(
        &self,
        prompt_tokens: i64,
        cached_tokens: i64,
        output_tokens: i64,
        now_s: f64,
    ) -> (f64, f64, f64, i64, i64) {
        let p = self
            .future
            .first_token(prompt_tokens, cached_tokens, output_tokens, now_s);
        (
            p.queue_wait_s,
            p.prefill_s,
            p.ttft_s,
            p.steps,
            p.queue_tokens_ahead,
        )
    }

    fn drain_s(&self, now_s: f64) -> f64 {
        self.future.drain_s(now_s)
    }

    /// The stretches, in the layout `from_stretches` takes.
    fn stretches(&self) -> Vec<StretchArg> {
        self.future
            .stretches
            .iter()
            .map(|s| {
                (
                    s.start_s,
                    s.steps,
                    s.per_step_s,
                    s.chunks.clone(),
                    s.budget_left,
                    s.running,
                    s.waiting,
                    s.kv_used,
                )
            })
            .collect()
    }

    #[getter]
    fn ready_s(&self) -> f64 {
        self.future.ready_s
    }

    #[getter]
    fn start_s(&self) -> f64 {
        self.future.start_s
    }

    #[getter]
    fn end_s(&self) -> f64 {
        self.future.end_s
    }

    #[getter]
    fn drained_s(&self) -> Option<f64> {
        self.future.drained_s
    }

    #[getter]
    fn tokens_ahead(&self) -> i64 {
        self.future.tokens_ahead
    }
}

#[pymodule]
fn foretoken_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(root_seed, m)?)?;
    m.add_function(wrap_pyfunction!(extra_key_mix, m)?)?;
    m.add_function(wrap_pyfunction!(chain, m)?)?;
    m.add_function(wrap_pyfunction!(chain_bytes, m)?)?;
    m.add_class::<NativeIndex>()?;
    m.add_class::<QueueFuture>()?;
    m.add(
        "APPLY_STATS_FIELDS",
        PyTuple::new(m.py(), ApplyStats::FIELDS)?,
    )?;
    m.add("TIERS", PyTuple::new(m.py(), TIERS)?)?;
    m.add("HASH_SPEC", hash::HASH_SPEC)?;
    m.add("SNAPSHOT_VERSION", snapshot::SNAPSHOT_VERSION)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

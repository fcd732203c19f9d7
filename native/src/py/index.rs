//! `NativeIndex`: the multi-tier prefix index ([`crate::index::Index`]) as a Python class.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyString, PyTuple};

use super::args::{extract_keys, extract_tokens, extract_u64s, TokenHold};
use super::events::{parse_events, Raw};
use super::outputs::{hit_tuple, per_tier, stats_dict, stats_tuple, u64_array, value_error};
use crate::index::{Event, Index};
use crate::snapshot;
use crate::worker::RecentPolicy;

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

//! Results to Python: hashes as a numpy array or bytes, counters as a tuple or a dict,
//! per-tier counts, a hit as a tuple, and errors.

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyTuple};

use crate::index::Hit;
use crate::space::TIERS;
use crate::stats::ApplyStats;

static FROMBUFFER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// A writable numpy uint64 array (little-endian) of the hashes.
pub(super) fn u64_array<'py>(py: Python<'py>, values: &[u64]) -> PyResult<Bound<'py, PyAny>> {
    let buffer = PyByteArray::new_with(py, values.len() * 8, |buf| {
        for (dst, v) in buf.chunks_exact_mut(8).zip(values) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    })?;
    let frombuffer = FROMBUFFER.import(py, "numpy", "frombuffer")?;
    frombuffer.call1((buffer, intern!(py, "<u8")))
}

pub(super) fn u64_bytes<'py>(py: Python<'py>, values: &[u64]) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, values.len() * 8, |buf| {
        for (dst, v) in buf.chunks_exact_mut(8).zip(values) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    })
}

pub(super) fn stats_tuple<'py>(
    py: Python<'py>,
    stats: &ApplyStats,
) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, stats.values())
}

pub(super) fn stats_dict<'py>(py: Python<'py>, stats: &ApplyStats) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (name, value) in ApplyStats::FIELDS.iter().zip(stats.values()) {
        dict.set_item(name, value)?;
    }
    Ok(dict)
}

/// `{tier name: count}` for a per-tier array (GPU, CPU, DISK, SHARED).
pub(super) fn per_tier<'py, T: IntoPyObject<'py>>(
    py: Python<'py>,
    counts: [T; 4],
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (tier, n) in TIERS.iter().zip(counts) {
        dict.set_item(tier, n)?;
    }
    Ok(dict)
}

pub(super) fn hit_tuple<'py>(py: Python<'py>, hit: &Hit) -> PyResult<Bound<'py, PyAny>> {
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

pub(super) fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

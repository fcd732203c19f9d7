//! The Python module `foretoken_native` (PyO3): the hash functions and `NativeIndex`.
//!
//! Inputs: token ids as packed bytes (u32 little-endian, what the router sends), any
//! buffer of u32/i32/i64/u64 (numpy arrays, `array.array`), or a sequence of ints (slow
//! path). Block hashes as bytes (u64 little-endian), a u64/i64 buffer, or ints. Everything
//! is converted before the index changes, so a malformed batch raises and changes nothing.
//!
//! By role: [`args`] converts the arguments, [`events`] parses KV events, [`outputs`]
//! builds the results; [`hashing`] holds the hash functions (and the built-in tokenizer's), [`index`] the `NativeIndex`
//! class, [`queue`] the `QueueFuture` class and [`held`] the `HeldChains` class.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::hash;
use crate::snapshot;
use crate::space::TIERS;
use crate::stats::ApplyStats;

mod args;
mod events;
mod hashing;
mod held;
mod index;
mod outputs;
mod queue;

#[pymodule]
fn foretoken_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(hashing::root_seed, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::extra_key_mix, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::chain, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::chain_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::sim_token_ids, m)?)?;
    m.add_class::<index::NativeIndex>()?;
    m.add_class::<queue::QueueFuture>()?;
    m.add_class::<held::HeldChains>()?;
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

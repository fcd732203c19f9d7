//! The module's hash functions: the chain's root seed, an extra key's mix, and the own
//! hashes of a prompt's full blocks (`chain`, `chain_bytes`).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::args::{extract_keys, extract_tokens};
use super::outputs::{u64_array, u64_bytes};
use crate::hash;
use crate::tokens;

/// The chain's starting value for one (salt, model, block size, LoRA adapter), spec v2.
#[pyfunction]
#[pyo3(signature = (salt, model, block_size, lora_name=None))]
pub(super) fn root_seed(salt: &[u8], model: &str, block_size: i64, lora_name: Option<&str>) -> u64 {
    hash::root_seed(salt, model, block_size, lora_name)
}

/// A block's extra key as a u64 (0 for "").
#[pyfunction]
pub(super) fn extra_key_mix(key: &str) -> u64 {
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
pub(super) fn chain<'py>(
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
pub(super) fn chain_bytes<'py>(
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

/// The built-in tokenizer's ids of ASCII `text` (bytes) as packed u32 little-endian, for a
/// vocabulary of `vocab_size` ids; computed without the GIL, so a large prompt tokenized
/// in a worker thread does not hold up the event loop.
#[pyfunction]
pub(super) fn sim_token_ids<'py>(
    py: Python<'py>,
    text: &[u8],
    vocab_size: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    if vocab_size <= tokens::RESERVED {
        return Err(PyValueError::new_err(format!(
            "vocab_size must be > {}",
            tokens::RESERVED
        )));
    }
    if !text.is_ascii() {
        return Err(PyValueError::new_err("sim_token_ids takes ASCII text only"));
    }
    // `text` borrows an immutable `bytes` the caller holds for the whole call
    let ids = py.detach(|| tokens::sim_token_ids(text, vocab_size));
    let bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
    Ok(PyBytes::new(py, &bytes))
}

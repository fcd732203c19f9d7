//! Arguments from Python, converted before anything changes: token ids ([`TokenHold`]),
//! block hashes, extra keys, medium names and optional values.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple};

use crate::hash::{self, Tokens};
use crate::space::{tier_index, TIERS};

/// Token ids held for the duration of a call: borrowed from a `bytes` object, or converted.
pub(super) enum TokenHold<'py> {
    Packed(Bound<'py, PyBytes>),
    Bytes(Vec<u8>),
    Ids(Vec<u32>),
}

impl TokenHold<'_> {
    pub(super) fn tokens(&self) -> Tokens<'_> {
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

/// A Python int as `u64`, the way `extract::<u64>()` reads it (OverflowError when negative
/// or ≥ 2^64) but through `PyLong_AsUnsignedLong` for an exact int: PyO3's `u64` goes
/// through `PyLong_AsUnsignedLongLong`, ~200 instructions for a full 64-bit hash on
/// CPython 3.11 (callgrind), against ~30.
#[allow(unsafe_code)] // one block, its proof beside it
fn u64_of(item: Borrowed<'_, '_, PyAny>) -> PyResult<u64> {
    #[cfg(all(target_pointer_width = "64", not(windows)))]
    if item.is_exact_instance_of::<PyInt>() {
        // SAFETY: `item` is a live object borrowed for the whole call (the GIL is held:
        // `Borrowed` carries the `'py` token), and an exact `int`, the type
        // `PyLong_AsUnsignedLong` takes; the call only reads it. `c_ulong` is 64 bits on
        // the LP64 targets this branch is compiled for, so the value is not truncated.
        let value = unsafe { pyo3::ffi::PyLong_AsUnsignedLong(item.as_ptr()) };
        if value == std::ffi::c_ulong::MAX {
            if let Some(err) = PyErr::take(item.py()) {
                return Err(err);
            }
        }
        return Ok(value);
    }
    item.extract::<u64>()
}

/// A token id of an item (an int in 0..2^32).
fn id_of(item: Borrowed<'_, '_, PyAny>) -> PyResult<u32> {
    token_id(item.extract::<i64>()?)
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

pub(super) fn extract_tokens<'py>(obj: &Bound<'py, PyAny>) -> PyResult<TokenHold<'py>> {
    if let Ok(bytes) = obj.cast::<PyBytes>() {
        packed_len_ok(bytes.as_bytes().len())?;
        return Ok(TokenHold::Packed(bytes.clone()));
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        // items borrowed: the tuple, immutable, holds them for the whole call
        let mut ids = Vec::with_capacity(tuple.len());
        for item in tuple.iter_borrowed() {
            ids.push(id_of(item)?);
        }
        return Ok(TokenHold::Ids(ids));
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
        out.push(u64_of(item?.as_borrowed())?);
    }
    Ok(out)
}

/// Block hashes (engine or own): bytes of u64 LE, a u64/i64 buffer, or a sequence of ints.
pub(super) fn extract_u64s(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
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
        let mut out = Vec::with_capacity(tuple.len());
        for item in tuple.iter_borrowed() {
            out.push(u64_of(item)?);
        }
        return Ok(out);
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

pub(super) fn extract_keys(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Option<u64>>> {
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
pub(super) fn tier_of(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    tier(obj.cast::<PyString>()?.to_str()?)
}

pub(super) fn opt_tier(obj: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    if obj.is_none() {
        return Ok(None);
    }
    Ok(Some(tier_of(obj)?))
}

pub(super) fn opt_string(obj: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    if obj.is_none() {
        return Ok(None);
    }
    Ok(Some(obj.cast::<PyString>()?.to_str()?.to_owned()))
}

pub(super) fn opt_u64(obj: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    if obj.is_none() {
        return Ok(None);
    }
    Ok(Some(u64_of(obj.as_borrowed())?))
}

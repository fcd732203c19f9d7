//! A software prefetch: starts loading the cache line holding a value, without waiting for
//! it. The index uses it to overlap the cache misses of a whole batch of events (a probe
//! into a table far larger than the caches costs one miss; forty independent ones issued
//! at once cost little more than one).
//!
//! One of the crate's two `unsafe` blocks (the other reads a Python int in `py::args`),
//! proven sound below.

#![allow(unsafe_code)]

/// Hints the CPU to load the cache line of `value` (no effect on any result).
#[inline(always)]
pub fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: `_mm_prefetch` requires the `sse` target feature, which every x86_64
        // target has (it is part of the x86_64 baseline; rustc enables it for all x86_64
        // targets), so the instruction exists. PREFETCHT0 never faults and never changes
        // memory or registers visible to the program: it is a hint, whatever the address.
        // The pointer is derived from a live reference anyway, so it is valid and aligned.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(value).cast::<i8>()) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = value; // no stable prefetch intrinsic elsewhere: a no-op
    }
}

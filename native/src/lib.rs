//! foretoken's native hot path: the chained own content hash (spec v2, [`hash`]), the
//! multi-tier prefix index ([`index::Index`]), a port of the Python reference
//! (`PrefixIndex`) with the cross-tier rule ([`recent`]), and the queue's recorded future
//! with the walk of a new request through it ([`queue`]), and the built-in tokenizer's
//! ids of ASCII text ([`tokens`]). The PyO3 bindings live in `py`
//! (feature `python`, on by default; maturin builds the module `foretoken_native`).

// `unsafe` is denied everywhere but in `prefetch` and `py::args::u64_of`, whose one block each
// carries its proof.
#![deny(unsafe_code)]

pub mod flat;
pub mod hash;
pub mod held;
pub mod index;
pub mod lru;
pub mod prefetch;
pub mod queue;
pub mod recent;
pub mod snapshot;
pub mod space;
pub mod spans;
pub mod stats;
pub mod table;
pub mod tokens;
pub mod walk;
pub mod worker;

#[cfg(feature = "python")]
mod py;

pub use index::{Event, Hit, Index, IndexError};
pub use space::TIERS;
pub use stats::ApplyStats;
pub use worker::{RecentPolicy, Stored};

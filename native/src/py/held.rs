//! `HeldChains`: the own-hash chains of prompts held by each worker ([`crate::held`]) as a
//! Python class.

use pyo3::prelude::*;

use super::args::extract_u64s;
use crate::held;

/// Per worker, the own block hashes of the prompts it holds, counted (see `crate::held`).
#[pyclass(module = "foretoken_native", name = "HeldChains")]
#[derive(Default)]
pub struct HeldChains {
    core: held::HeldChains,
}

#[pymethods]
impl HeldChains {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    fn add(&mut self, worker_id: &str, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        self.core.add(worker_id, &extract_u64s(hashes)?);
        Ok(())
    }

    fn remove(&mut self, worker_id: &str, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        self.core.remove(worker_id, &extract_u64s(hashes)?);
        Ok(())
    }

    fn forget_worker(&mut self, worker_id: &str) {
        self.core.forget_worker(worker_id);
    }

    fn holds(&self, worker_id: &str) -> bool {
        self.core.holds(worker_id)
    }

    /// For each worker of `worker_ids`, how many leading blocks of `chain` (at most
    /// `max_blocks`) a prompt it holds shares.
    fn depths(
        &self,
        chain: &Bound<'_, PyAny>,
        max_blocks: usize,
        worker_ids: Vec<String>,
    ) -> PyResult<Vec<usize>> {
        let chain = extract_u64s(chain)?;
        Ok(worker_ids
            .iter()
            .map(|w| self.core.depth(w, &chain, max_blocks))
            .collect())
    }
}

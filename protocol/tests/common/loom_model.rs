//! Running a loom model and counting what it explored (for the `loom_*` tests).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Runs `model` under loom with the given preemption bound (unless `LOOM_MAX_PREEMPTIONS`
/// says otherwise) and returns how many executions were explored. The models assert a
/// minimum on it: a model that explores too little would pass without checking anything.
pub fn check(bound: usize, model: impl Fn() + Sync + Send + 'static) -> usize {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(bound);
    }
    let model = Arc::new(model);
    // std atomics: the count spans executions, outside loom's model.
    let runs = Arc::new(AtomicUsize::new(0));
    let n = runs.clone();
    b.check(move || {
        n.fetch_add(1, Ordering::Relaxed);
        model()
    });
    let runs = runs.load(Ordering::Relaxed);
    eprintln!("explored {runs} executions");
    runs
}

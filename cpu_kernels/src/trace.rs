//! Which kernels ran. Every engine entry point (and every stage op with a kernel of its own) calls
//! `ran` with the name of the code path it took; while a thread records (`start`), the names are
//! collected in order with a count, and `take` hands them over. `shared::breakdown` takes them at
//! every part boundary, so each part of `--breakdown` says which kernels it executed — read from
//! the path that ran, not from the flags. Off (the default), `ran` is one thread-local read.

use std::cell::RefCell;

thread_local! {
    static LOG: RefCell<Option<Vec<(String, usize)>>> = const { RefCell::new(None) };
}

/// Begin recording on this thread (an empty log).
pub fn start() {
    LOG.with(|l| *l.borrow_mut() = Some(Vec::new()));
}

/// Stop recording on this thread; returns what was recorded since the last `take`.
pub fn stop() -> Vec<String> {
    LOG.with(|l| l.borrow_mut().take()).map(render).unwrap_or_default()
}

/// What was recorded since the last `take` (or `start`), in first-run order, "name ×n" where a
/// kernel ran n > 1 times; recording goes on.
pub fn take() -> Vec<String> {
    LOG.with(|l| l.borrow_mut().as_mut().map(std::mem::take)).map(render).unwrap_or_default()
}

/// Whether this thread is recording.
pub fn recording() -> bool {
    LOG.with(|l| l.borrow().is_some())
}

/// `kernel` ran (a no-op unless this thread is recording).
pub fn ran(kernel: &str) {
    LOG.with(|l| {
        if let Some(log) = l.borrow_mut().as_mut() {
            match log.iter_mut().find(|(k, _)| k == kernel) {
                Some((_, n)) => *n += 1,
                None => log.push((kernel.to_string(), 1)),
            }
        }
    });
}

/// `ran` with a name built only when recording.
pub fn ran_with(kernel: impl FnOnce() -> String) {
    if recording() {
        ran(&kernel());
    }
}

fn render(log: Vec<(String, usize)>) -> Vec<String> {
    log.into_iter().map(|(k, n)| if n > 1 { format!("{k} ×{n}") } else { k }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_while_on_with_counts_in_order() {
        ran("before");
        start();
        ran("gemm");
        ran("add");
        ran("gemm");
        assert_eq!(take(), ["gemm ×2", "add"]);
        ran_with(|| "attention".into());
        assert_eq!(stop(), ["attention"]);
        ran("after");
        assert!(!recording());
        assert!(take().is_empty() && stop().is_empty());
    }
}

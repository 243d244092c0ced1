//! The lift binary refuses a `RAYON_NUM_THREADS` its thread pool cannot start, or would read as
//! another count, with exit 2 and a sentence, before building the model.

use std::process::Command;

fn lift_with_threads(value: &str) -> (Option<i32>, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_lift")).env("RAYON_NUM_THREADS", value).output().unwrap();
    (o.status.code(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}

#[test]
fn a_thread_count_rayon_cannot_start_or_would_misread_exits_2() {
    // 100000: candle's pool panicked on it (exit 134). " 1 ": rayon reads it untrimmed, fails to
    // parse it and starts one thread per core. "many", "-1", "": no count at all.
    for value in ["100000", " 1 ", "many", "-1", ""] {
        let (code, text) = lift_with_threads(value);
        assert_eq!(code, Some(2), "RAYON_NUM_THREADS={value:?}: {text}");
        assert!(text.contains("RAYON_NUM_THREADS") && text.contains("Fix:"), "{value:?}: {text}");
        assert!(!text.contains("panicked") && !text.contains("check:"), "refused before any work: {text}");
    }
}

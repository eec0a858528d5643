//! The `flashsample` binary on bad input: a typed error on one line, never a panic, and the
//! check's wording on a small run.

use std::process::Command;

/// Runs `flashsample ARGS`: (success, stdout, stderr).
fn flashsample(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_flashsample")).args(args).env("RUST_BACKTRACE", "0").output().expect("spawn flashsample");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let small = ["--vocab", "1000", "--dim", "16"];
    for (args, want) in [
        (vec!["--dim", "0"], "must be at least 1"),
        (vec!["--batch", "0"], "must be at least 1"),
        (vec!["--vocab", "0"], "must be at least 1"),
        (vec!["--reps", "0"], "must be at least 1"),
        (vec!["--top-p", "2"], "top_p is 2"),
        (vec!["--top-k", "65"], "max_k = 64"),
        (vec!["--temperature", "-1"], "temperature of row 0 is -1"),
        (vec!["--device", "cpu:0"], "0 CPU threads requested"),
        (vec!["--device", "cpu:5000"], "5000 CPU threads requested"),
        (vec!["--device", "tpu"], "unknown device"),
        (vec!["--vocab", "2147483648", "--dim", "1099511627776"], "matrix"),
        (vec!["--vocab", "18446744073709551615"], "vocab_offset 0"),
    ] {
        let mut all = vec!["sample"];
        for pair in small.chunks(2) {
            if !args.contains(&pair[0]) {
                all.extend(pair);
            }
        }
        all.extend(&args);
        let (ok, _, err) = flashsample(&all);
        assert!(!ok, "{args:?} succeeded");
        assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
        assert!(err.contains(want), "{args:?}: expected `{want}` in:\n{err}");
    }
}

#[test]
fn an_invalid_pipeline_is_reported_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.ir");
    std::fs::write(
        &path,
        "pipeline X\n  hidden: bf16[B, D]\n  weights: bf16[V, D]\n  logits = matmul(hidden, weights)\n  logits = softcap(logits, -1)\n  sample = argmax(logits)\n",
    )
    .unwrap();
    let (ok, _, err) = flashsample(&["sample", "--pipeline", path.to_str().unwrap()]);
    assert!(!ok);
    assert_eq!(err.matches("softcap must be finite").count(), 1, "the message is printed once:\n{err}");
    let (ok, _, err) = flashsample(&["sample", "--pipeline", "/nonexistent/p.ir"]);
    assert!(!ok && err.contains("reading /nonexistent/p.ir") && err.contains("No such file"), "{err}");
}

#[test]
fn the_check_says_which_rows_it_checked() {
    let (ok, out, err) = flashsample(&["sample", "--vocab", "2000", "--dim", "32", "--batch", "10", "--reps", "1"]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("8 samples of rows 0..8 match the float64 reference pathwise"), "{out}");
    let (ok, out, _) = flashsample(&["sample", "--vocab", "2000", "--dim", "32", "--batch", "2", "--reps", "1", "--no-check"]);
    assert!(ok && !out.contains("float64"), "{out}");
}

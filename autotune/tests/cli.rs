//! The autotuner end to end on a small CPU shape: measure, write, resume, and the runtime
//! reading the result (one test, since it sets a process-wide environment variable).

use flashsample::{
    ir::{DType, Outputs, PipelineBuilder},
    tuning::{TuningFile, TUNING_ENV},
    Device, KernelConfig, Sampler,
};
use std::process::Command;

fn autotune(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_flashsample-autotune")).args(args).output().expect("spawn autotune");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "autotune failed:\n{text}");
    text
}

#[test]
fn tunes_resumes_and_the_runtime_uses_the_result() {
    let dir = std::env::temp_dir().join(format!("fs-autotune-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("tuning.json");
    let out_s = out.to_str().unwrap();
    let common = ["--vocab", "3001", "--hidden", "48", "--batch", "1,5", "--device", "cpu:2", "--reps", "2", "--warmup", "1", "--out", out_s];

    let first = autotune(&common);
    assert!(first.contains("2 of 2 shapes to measure"), "{first}");
    // Progress while it works, one line per shape when nobody watches a terminal.
    assert!(first.contains("D=48 V=3001 B=5: measuring"), "{first}");
    assert!(first.contains("D=48 V=3001 B=1: saved"), "{first}");
    assert!(first.contains("| 5 | 1 |"), "table lists the best config for B=5:\n{first}");
    let file = TuningFile::load(&out).unwrap();
    assert_eq!(file.devices.len(), 1);
    let entries = &file.devices[0].entries;
    assert_eq!(entries.len(), 2);
    assert!(entries.iter().all(|e| e.best.median_us > 0.0 && e.heuristic.median_us > 0.0));

    let resumed = autotune(&[&common[..], &["--resume"]].concat());
    assert!(resumed.contains("0 of 2 shapes to measure"), "{resumed}");
    assert_eq!(TuningFile::load(&out).unwrap(), file, "resume must not re-measure");

    // The runtime picks the tuned config for the nearest bucket.
    std::env::set_var(TUNING_ENV, &out);
    let p = PipelineBuilder::new("sampling", DType::BF16, DType::BF16)
        .temperature_per_row("temperature")
        .outputs(Outputs { score: true, ..Outputs::default() })
        .build()
        .unwrap();
    let sampler = Sampler::new(p, &Device::cpu_with_threads(2).unwrap()).unwrap();
    let best_b5: KernelConfig = serde_json::from_value(entries.iter().find(|e| e.shape.batch == 5).unwrap().best.config.clone()).unwrap();
    assert_eq!(sampler.config_for(6, 48, 3001), best_b5);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn pruned_search_fits_its_budget_over_several_heads() {
    let dir = std::env::temp_dir().join(format!("fs-autotune-pruned-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("tuning.json");
    let t = std::time::Instant::now();
    let text = autotune(&[
        "--shapes", "48:3001,32:1000", "--batch", "1,4", "--device", "cpu:2", "--budget-s", "20", "--top-heuristic", "3",
        "--quick-reps", "1", "--finalists", "2", "--reps", "2", "--warmup", "1", "--out", out.to_str().unwrap(),
    ]);
    assert!(t.elapsed().as_secs_f64() < 60.0, "budget ignored:\n{text}");
    assert!(text.contains("4 of 4 shapes to measure"), "{text}");
    let file = TuningFile::load(&out).unwrap();
    let entries = &file.devices[0].entries;
    assert_eq!(entries.len(), 4);
    // Only finalists (fully re-timed) are reported, and the heuristic where it beat them.
    assert!(entries.iter().all(|e| !e.top.is_empty() && e.top.len() <= 3 && e.best.median_us > 0.0), "{entries:?}");
    assert!(entries.iter().all(|e| e.best.median_us <= e.heuristic.median_us), "never slower than the heuristic: {entries:?}");
    assert!(entries.iter().any(|e| e.shape.dim == 32 && e.shape.vocab == 1000));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    for (args, want) in [
        (&["--batch", "0"][..], "must be at least 1"),
        (&["--batch", "1,0"], "must be at least 1"),
        (&["--vocab", "0"], "must be at least 1"),
        (&["--hidden", "0"], "must be at least 1"),
        (&["--reps", "0"], "must be at least 1"),
        (&["--budget-s", "-1"], "not a positive number of seconds"),
        (&["--budget-s", "NaN"], "not a positive number of seconds"),
        (&["--shapes", "0:1000"], "must be at least 1"),
        (&["--device", "cpu:0"], "0 CPU threads requested"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_flashsample-autotune"))
            .args(args)
            .args(["--out", "/nonexistent/never-written.json"])
            .env("RUST_BACKTRACE", "0")
            .output()
            .expect("spawn autotune");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
        assert!(err.contains(want), "{args:?}: expected `{want}` in:\n{err}");
    }
}

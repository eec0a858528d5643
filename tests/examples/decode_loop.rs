//! A decode loop whose tokens never leave the GPU: each step gathers the embeddings of the
//! last tokens into the hidden states (a toy model's "forward"), then samples the next tokens
//! with the device API (`cuda::SamplingPlan`), on one stream, with no host round trip. The
//! steps run once directly and once as one CUDA graph; both must equal a host-API loop.
//! Prints steps/s of each and the per-step split (gather, sampling) from CUDA events.
//!
//! `cargo run --release -p flashsample-tests --example decode_loop -- [--batch 16] [--dim 4096] [--vocab 151936] [--steps 256] [--device-steps]`

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use flashsample::Sampler;
use flashsample_tests::gpu::{addr, gpu, ToyDecode, ToyKernels};
use std::time::Instant;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(default, |v| v.parse().unwrap_or_else(|e| panic!("{name}: {e}")))
}

fn main() {
    let (batch, dim, vocab, steps) = (arg("--batch", 16), arg("--dim", 4096), arg("--vocab", 151_936), arg("--steps", 256));
    // Per-step noise (row steps advanced on the device) needs kernels that take them.
    let with_steps = std::env::args().any(|a| a == "--device-steps");
    let (device, dev) = gpu();
    println!("{}: B = {batch}, D = {dim}, V = {vocab}, {steps} steps{}", device.describe(), if with_steps { ", device step counters" } else { "" });
    let toy = ToyDecode::new(batch, dim, vocab, 1);
    let sampler = Sampler::new(toy.pipeline.clone(), &device).expect("sampler");
    let plan = sampler.cuda().expect("a CUDA sampler").plan(batch, dim, vocab).expect("plan");
    let kernels = ToyKernels::load(&dev);
    let stream = dev.context().new_stream().expect("stream");

    // Host API: hidden states built on the host, tokens read back every step.
    let b = toy.buffers(&dev, steps);
    let t = Instant::now();
    let want = toy.host_loop(&sampler, &b.weights, steps, with_steps);
    let host_s = t.elapsed().as_secs_f64();

    // Device API, step by step on one stream, one synchronization at the end.
    toy.enqueue_step(&kernels, &plan, &stream, &b, 0, with_steps); // warm-up (module loads, first launch)
    stream.synchronize().expect("sync");
    let b = toy.buffers(&dev, steps);
    let t = Instant::now();
    for step in 0..steps {
        toy.enqueue_step(&kernels, &plan, &stream, &b, step, with_steps);
    }
    stream.synchronize().expect("sync");
    let direct_s = t.elapsed().as_secs_f64();
    let (direct, status) = toy.read(&stream, &b, steps);
    assert!(status.iter().all(|&s| s == 0), "a row failed: {status:?}");
    assert_eq!(direct, want, "the device loop differs from the host loop");

    // The whole loop as one graph.
    let g = toy.buffers(&dev, steps);
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).expect("capture");
    for step in 0..steps {
        toy.enqueue_step(&kernels, &plan, &stream, &g, step, with_steps);
    }
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).expect("end capture").expect("a graph");
    graph.upload().expect("graph upload");
    stream.synchronize().expect("sync");
    let t = Instant::now();
    graph.launch().expect("graph launch");
    stream.synchronize().expect("sync");
    let graph_s = t.elapsed().as_secs_f64();
    let (replayed, _) = toy.read(&stream, &g, steps);
    assert_eq!(replayed, want, "the graph differs from the host loop");

    // Per-step split from events around the gather and the sampling of a few steps.
    let ctx = dev.context();
    let ev = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
    let (mut gather_us, mut sample_us) = (Vec::new(), Vec::new());
    for step in 0..steps.min(32) {
        let (e0, e1, e2) = (ev(), ev(), ev());
        e0.record(&stream).expect("record");
        let history = addr(&b.history, &stream) + (step * batch * 4) as u64;
        kernels.gather(&stream, b.table.device_address(), history, addr(&b.hidden, &stream), batch, dim, vocab);
        e1.record(&stream).expect("record");
        toy.enqueue_step(&kernels, &plan, &stream, &b, step, with_steps);
        e2.record(&stream).expect("record");
        stream.synchronize().expect("sync");
        gather_us.push(f64::from(e0.elapsed_ms(&e1).expect("elapsed")) * 1e3);
        // enqueue_step gathers again before sampling: subtract one gather.
        sample_us.push(f64::from(e1.elapsed_ms(&e2).expect("elapsed")) * 1e3 - gather_us.last().copied().unwrap_or(0.0));
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let per = |s: f64| s / steps as f64 * 1e6;
    println!("tokens equal the host-API loop at every step ({steps} steps, {batch} rows)");
    println!("| loop | steps/s | us/step |");
    println!("|---|---:|---:|");
    for (name, s) in [("host API", host_s), ("device API", direct_s), ("one CUDA graph", graph_s)] {
        println!("| {name} | {:.0} | {:.1} |", steps as f64 / s, per(s));
    }
    println!("per-step split (device time, median of {}): gather {:.1} us, sampling {:.1} us", gather_us.len(), median(gather_us), median(sample_us));
}

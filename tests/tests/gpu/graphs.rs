//! The device API inside CUDA graphs: a captured launch replayed while a device kernel
//! advances the step counters, and a decode loop whose tokens never leave the GPU (embedding
//! gather, sample, 256 steps in one graph), each equal to the host API step for step.
//!
//! Every test needs a CUDA GPU: they are ignored by default and fail without one. Run them with
//! `cargo test --release -p flashsample-tests --test gpu -- --include-ignored`.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use flashsample::cuda::{DeviceIn, DeviceInputs, DeviceMatrix, DeviceOut, DeviceOutputs};
use flashsample::Sampler;
use flashsample_tests::gpu::{addr, gpu, DecodeBuffers, ToyDecode, ToyKernels};

const CAPTURE: CUstreamCaptureMode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_launch_replays_with_fresh_steps() {
    let (device, dev) = gpu();
    for (batch, dim, vocab) in [(4usize, 256usize, 32_000usize), (64, 512, 151_936)] {
        let toy = ToyDecode::new(batch, dim, vocab, 3);
        let sampler = Sampler::new(toy.pipeline.clone(), &device).unwrap();
        let plan = sampler.cuda().unwrap().plan(batch, dim, vocab).unwrap();
        let kernels = ToyKernels::load(&dev);
        let b: DecodeBuffers = toy.buffers(&dev, 1);
        // Fixed hidden states (the first tokens' embeddings), so only the step changes the noise.
        let stream = dev.context().new_stream().unwrap();
        kernels.gather(&stream, b.table.device_address(), addr(&b.history, &stream), addr(&b.hidden, &stream), batch, dim, vocab);
        stream.synchronize().unwrap();
        let mut tokens = stream.alloc_zeros::<u32>(batch).unwrap();
        let mut status = stream.alloc_zeros::<u32>(batch).unwrap();

        stream.begin_capture(CAPTURE).unwrap();
        {
            let mut inputs = DeviceInputs::new(DeviceMatrix::new(&b.hidden, batch, dim, &stream).unwrap(), DeviceMatrix::from_tensor(&b.weights), 0);
            inputs.temperatures = Some(DeviceIn::new(&b.temperatures, &stream).unwrap());
            inputs.row_seeds = Some(DeviceIn::new(&b.row_seeds, &stream).unwrap());
            inputs.row_steps = Some(DeviceIn::new(&b.steps, &stream).unwrap());
            let outputs = DeviceOutputs::new(DeviceOut::new(&mut tokens, &stream).unwrap(), DeviceOut::new(&mut status, &stream).unwrap());
            plan.launch(&stream, inputs, outputs).unwrap();
            kernels.advance(&stream, addr(&b.steps, &stream), batch);
        }
        let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a captured graph");

        let hidden: Vec<flashsample::bf16> =
            toy.first.iter().flat_map(|&t| toy.table.bf16_elements()[t as usize * dim..][..dim].iter().copied()).collect();
        let mut distinct = std::collections::HashSet::new();
        for replay in 0..100u32 {
            graph.launch().unwrap();
            let got = stream.clone_dtoh(&tokens).unwrap();
            let st = stream.clone_dtoh(&status).unwrap();
            stream.synchronize().unwrap();
            let steps = vec![replay; batch];
            let want = sampler
                .sample(flashsample::Tensor::host(&hidden, batch, dim).unwrap(), flashsample::Tensor::device(&b.weights), &toy.params(Some(&steps)))
                .unwrap();
            assert_eq!(st, vec![0; batch], "B={batch} replay {replay}");
            assert_eq!(got, want.tokens, "B={batch} replay {replay}: the graph's tokens differ from the host API at that step");
            distinct.insert(got);
        }
        assert!(distinct.len() > 50, "B={batch}: 100 replays gave only {} distinct samples: the step does not reach the noise", distinct.len());
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_decode_loop_of_256_steps_in_one_graph_equals_the_host_loop() {
    let (device, dev) = gpu();
    const STEPS: usize = 256;
    for (batch, dim, vocab) in [(3usize, 128usize, 5_000usize), (16, 1024, 151_936)] {
        let toy = ToyDecode::new(batch, dim, vocab, 11);
        let sampler = Sampler::new(toy.pipeline.clone(), &device).unwrap();
        let plan = sampler.cuda().unwrap().plan(batch, dim, vocab).unwrap();
        let kernels = ToyKernels::load(&dev);
        // Without per-step noise: the hidden states change every step, the noise is the
        // request's (seed, row). `a_captured_launch_replays_with_fresh_steps` covers the steps.
        let b = toy.buffers(&dev, STEPS);
        let want = toy.host_loop(&sampler, &b.weights, STEPS, false);

        // The device loop, step by step without a graph.
        let stream = dev.context().new_stream().unwrap();
        for step in 0..STEPS {
            toy.enqueue_step(&kernels, &plan, &stream, &b, step, false);
        }
        let (direct, status) = toy.read(&stream, &b, STEPS);
        assert!(status.iter().all(|&s| s == 0));
        assert_eq!(direct, want, "B={batch} V={vocab}: device loop vs host loop");

        // The same 256 steps captured into one graph, run on fresh buffers.
        let g = toy.buffers(&dev, STEPS);
        stream.begin_capture(CAPTURE).unwrap();
        for step in 0..STEPS {
            toy.enqueue_step(&kernels, &plan, &stream, &g, step, false);
        }
        let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a captured graph");
        graph.launch().unwrap();
        let (replayed, status) = toy.read(&stream, &g, STEPS);
        assert!(status.iter().all(|&s| s == 0));
        assert_eq!(replayed, want, "B={batch} V={vocab}: graph vs host loop");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_decode_loop_with_device_steps_equals_the_host_loop() {
    let (device, dev) = gpu();
    const STEPS: usize = 64;
    let toy = ToyDecode::new(8, 256, 32_000, 5);
    let sampler = Sampler::new(toy.pipeline.clone(), &device).unwrap();
    let plan = sampler.cuda().unwrap().plan(8, 256, 32_000).unwrap();
    let kernels = ToyKernels::load(&dev);
    let b = toy.buffers(&dev, STEPS);
    let want = toy.host_loop(&sampler, &b.weights, STEPS, true);
    let stream = dev.context().new_stream().unwrap();
    stream.begin_capture(CAPTURE).unwrap();
    for step in 0..STEPS {
        toy.enqueue_step(&kernels, &plan, &stream, &b, step, true);
    }
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a captured graph");
    graph.launch().unwrap();
    let (got, _) = toy.read(&stream, &b, STEPS);
    assert_eq!(got, want);
}

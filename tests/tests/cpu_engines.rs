//! Every CPU engine against the float64 reference, pathwise: each engine is forced through an
//! explicit config (the runtime's heuristic picks the fastest one the host runs, so the other
//! tests cover that one; these cover the Cranelift fallback too), and through the
//! `FLASHSAMPLE_CPU_ENGINE` override. An engine this host lacks must refuse with a typed error.

use flashsample::{CpuConfig, CpuEngine, Device, Error, KernelConfig, Sampler};
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::Case;
use proptest::prelude::*;

const ALL_OUTPUTS: Outputs = Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 };

/// bf16 × bf16 pipelines: the dtypes every engine runs.
fn pipelines() -> Vec<Pipeline> {
    vec![
        PipelineBuilder::new("Plain", DType::BF16, DType::BF16)
            .outputs(Outputs { score: true, ..Outputs::default() })
            .build()
            .unwrap(),
        PipelineBuilder::new("Qwen", DType::BF16, DType::BF16)
            .temperature_per_row("temperature")
            .bias("bias")
            .mask("allowed")
            .ban("banned")
            .softcap(30.0)
            .gumbel("seed", 3)
            .outputs(ALL_OUTPUTS)
            .build()
            .unwrap(),
        PipelineBuilder::new("Serving", DType::BF16, DType::BF16)
            .logit_bias("logit_bias")
            .penalties("penalties")
            .temperature_per_row("temperature")
            .mask("allowed")
            .filter("filter", 8)
            .gumbel("seed", 2)
            .outputs(Outputs { top_logprobs: 5, ..ALL_OUTPUTS })
            .build()
            .unwrap(),
    ]
}

fn config(engine: CpuEngine, batch: usize, dim: usize, vocab: usize) -> KernelConfig {
    KernelConfig::Cpu(CpuConfig { threads: 2, ..CpuConfig::heuristic_for_engine(engine, batch, dim, vocab) })
}

/// The engines this host runs. For the others, checks that a launch is a typed error naming
/// the missing CPU feature.
fn runnable_engines() -> Vec<CpuEngine> {
    let p = &pipelines()[0];
    let sampler = Sampler::new(p.clone(), &Device::cpu_with_threads(2).unwrap()).unwrap();
    let case = Case::random(p, 2, 16, 40, 1, 3.0);
    CpuEngine::ALL
        .into_iter()
        .filter(|&engine| match engine.missing_host_feature() {
            None => true,
            Some(feature) => {
                match case.run_with(&sampler, &config(engine, 2, 16, 40)) {
                    Err(Error::CpuCodegen(e)) => assert!(e.to_string().contains(feature), "{e}"),
                    other => panic!("{engine} on a host without {feature}: {other:?}"),
                }
                eprintln!("engine {engine}: this host lacks {feature}; checked the typed error");
                false
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Same seed ⇒ the reference's sample (up to near-ties within the derived bound), row by
    /// row, on every engine, for random shapes around the engines' tile and block sizes.
    #[test]
    fn every_engine_pathwise_against_reference(
        which in 0usize..3,
        batch in 1usize..40,
        dim in prop::sample::select(vec![1usize, 7, 31, 32, 33, 64, 129, 200]),
        vocab in 1usize..1500,
        seed in any::<u64>(),
    ) {
        let pipeline = &pipelines()[which];
        let sampler = Sampler::new(pipeline.clone(), &Device::cpu_with_threads(2).unwrap()).unwrap();
        let case = Case::random(pipeline, batch, dim, vocab, seed, 3.0);
        let rows: Vec<usize> = (0..batch).collect();
        for engine in runnable_engines() {
            let samples =
                case.run_with(&sampler, &config(engine, batch, dim, vocab)).map_err(|e| TestCaseError::fail(format!("{engine}: {e}")))?;
            case.check(pipeline, &samples, &rows).map_err(|e| TestCaseError::fail(format!("{engine}: {e}")))?;
        }
    }
}

#[test]
fn every_engine_pathwise_at_qwen_scale() {
    let pipeline = &pipelines()[1];
    let sampler = Sampler::new(pipeline.clone(), &Device::cpu_with_threads(2).unwrap()).unwrap();
    for (batch, dim) in [(3, 256), (13, 100)] {
        let case = Case::random(pipeline, batch, dim, 151_936, 7, 4.0);
        let rows: Vec<usize> = (0..batch).collect();
        for engine in runnable_engines() {
            let samples = case.run_with(&sampler, &config(engine, batch, dim, 151_936)).unwrap();
            case.check(pipeline, &samples, &rows).unwrap_or_else(|e| panic!("{engine} B={batch} D={dim}: {e}"));
        }
    }
}

/// Every engine's row logsumexp is `abi::lse`'s exact sum of the row's allowed logits, bit for
/// bit. The inputs are small integers, so every dot-product order (Cranelift's, AVX-512-BF16's,
/// the AMX tiles') gives the same exact logits and the host knows them: rows of ±1 entries keep
/// their logits within a few windows of the top, rows of ±3 spread them over a dozen (terms
/// dropped, tops promoted); batches of 1 to 20 rows take every engine's block shapes, and
/// the vocabulary ends inside a quad.
#[test]
fn every_engine_sums_the_logsumexp_as_the_abi() {
    use flashsample_abi::lse::{LsePartial, LseSum};
    use flashsample_tests::MatrixData;
    use rand::{rngs::StdRng, Rng, SeedableRng};
    let pipeline = PipelineBuilder::new("Lse", DType::BF16, DType::BF16)
        .mask("allowed")
        .gumbel("seed", 1)
        .outputs(Outputs { score: true, logsumexp: true, ..Outputs::default() })
        .build()
        .unwrap();
    let sampler = Sampler::new(pipeline.clone(), &Device::cpu_with_threads(2).unwrap()).unwrap();
    let (dim, vocab) = (96, 3001);
    let mut rng = StdRng::seed_from_u64(5);
    let weights: Vec<f32> = (0..vocab * dim).map(|_| rng.random_range(-3i32..=3) as f32).collect();
    for batch in [1, 5, 20] {
        let hidden: Vec<f32> = (0..batch * dim).map(|i| if (i / dim) % 2 == 0 { rng.random_range(-1i32..=1) } else { rng.random_range(-3i32..=3) } as f32).collect();
        let mut case = Case::random(&pipeline, batch, dim, vocab, 9, 1.0);
        case.hidden = MatrixData::from_f32(DType::BF16, batch, dim, &hidden);
        case.weights = MatrixData::from_f32(DType::BF16, vocab, dim, &weights);
        let words = vocab.div_ceil(32);
        let want: Vec<u32> = (0..batch)
            .map(|r| {
                let mut p = LsePartial::EMPTY;
                for v in (0..vocab).filter(|&v| case.mask[r * words + v / 32] >> (v % 32) & 1 == 1) {
                    p.add((0..dim).map(|d| hidden[r * dim + d] * weights[v * dim + d]).sum());
                }
                LseSum::of(&[p]).logsumexp().to_bits()
            })
            .collect();
        for engine in runnable_engines() {
            let samples = case.run_with(&sampler, &config(engine, batch, dim, vocab)).unwrap();
            let got: Vec<u32> = samples.logsumexp.unwrap().iter().map(|x| x.to_bits()).collect();
            assert_eq!(got, want, "{engine} B={batch}");
        }
    }
}

/// `FLASHSAMPLE_CPU_ENGINE` picks the engine of `Sampler::sample`'s configs for pipelines it can
/// run and leaves the others on Cranelift. (The only test here that reads the environment.)
#[test]
fn the_environment_forces_an_engine() {
    let bf16 = &pipelines()[1];
    let f32_pipeline = PipelineBuilder::new("F32", DType::F32, DType::BF16).build().unwrap();
    for engine in runnable_engines() {
        // SAFETY: no other test of this binary reads or writes the environment.
        unsafe { std::env::set_var("FLASHSAMPLE_CPU_ENGINE", engine.to_string()) };
        let sampler = Sampler::new(bf16.clone(), &Device::cpu_with_threads(2).unwrap()).unwrap();
        match sampler.config_for(5, 64, 1000) {
            KernelConfig::Cpu(c) => assert_eq!(c.engine, engine),
            other => panic!("{other:?}"),
        }
        let case = Case::random(bf16, 5, 64, 1000, 3, 3.0);
        case.check(bf16, &case.run(&sampler).unwrap(), &[0, 1, 2, 3, 4]).unwrap();
        let sampler = Sampler::new(f32_pipeline.clone(), &Device::cpu_with_threads(2).unwrap()).unwrap();
        match sampler.config_for(5, 64, 1000) {
            KernelConfig::Cpu(c) => assert_eq!(c.engine, CpuEngine::Cranelift),
            other => panic!("{other:?}"),
        }
    }
    unsafe { std::env::remove_var("FLASHSAMPLE_CPU_ENGINE") };
}

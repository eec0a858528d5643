//! Benchmark helpers shared by the bench binaries: timing and table printing.

use std::time::Instant;

/// Median wall time of `reps` calls of `f` after `warmup` untimed calls, in seconds.
pub fn median_secs<E>(warmup: usize, reps: usize, mut f: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    for _ in 0..warmup {
        f()?;
    }
    let mut t: Vec<f64> = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Prints a markdown table (so it pastes into BENCHMARKS.md as is).
pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    println!("| {} |", header.join(" | "));
    println!("|{}|", header.iter().map(|_| "---:").collect::<Vec<_>>().join("|"));
    for r in rows {
        println!("| {} |", r.join(" | "));
    }
}

//! How long each part of a task took: printed as each part ends and as a table at the end,
//! so a slow CI run shows where its time went.

use std::time::{Duration, Instant};

#[derive(Default)]
pub struct Parts {
    current: Option<(String, Instant)>,
    done: Vec<(String, Duration)>,
}

impl Parts {
    /// Ends the running part (if any) and starts `name`.
    pub fn start(&mut self, name: &str) {
        self.end();
        crate::step(name);
        self.current = Some((name.to_string(), Instant::now()));
    }

    fn end(&mut self) {
        if let Some((name, started)) = self.current.take() {
            let took = started.elapsed();
            println!("<== {name}: {}", minutes(took));
            self.done.push((name, took));
        }
    }

    /// Ends the running part and prints every part's time and the total.
    pub fn report(mut self) {
        self.end();
        println!("==> time per part:");
        let mut total = Duration::ZERO;
        for (name, took) in &self.done {
            println!("    {:>8}  {name}", minutes(*took));
            total += *took;
        }
        println!("    {:>8}  total", minutes(total));
    }
}

fn minutes(d: Duration) -> String {
    let s = d.as_secs();
    format!("{}m{:02}s", s / 60, s % 60)
}

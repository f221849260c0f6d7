//! A steady load on a running mocker fleet, for measuring what the fleet costs.
//!
//! ```text
//! kvbm-mocker --workers 16 --model-path DIR --speedup 10 --ready-file READY &
//! cargo run --release -p kvbm-mocker --example load -- READY SECONDS CONCURRENCY
//! ```
//!
//! Each worker gets CONCURRENCY closed loops of streamed completions (a 512-token prompt of
//! which the first 256 tokens are shared by every request of the worker, 64 tokens out) for
//! SECONDS of wall time. Prints requests done and, per worker, the steps per wall second, the
//! simulated seconds elapsed and the largest lag its metrics report.

use std::time::{Duration, Instant};

use serde_json::Value;

async fn info(c: &reqwest::Client, http: &str) -> Value {
    let text = c
        .get(format!("{http}/v1/kvbm/mocker"))
        .send()
        .await
        .expect("the worker answers")
        .text()
        .await
        .expect("a body");
    serde_json::from_str(&text).expect("JSON")
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if argv.len() != 4 {
        eprintln!("usage: load READY_FILE SECONDS CONCURRENCY_PER_WORKER");
        std::process::exit(2);
    }
    let ready = std::fs::read_to_string(&argv[1]).expect("reading the ready file");
    let seconds: f64 = argv[2].parse().expect("SECONDS is a number");
    let concurrency: usize = argv[3].parse().expect("CONCURRENCY is an integer");
    let https: Vec<String> = ready
        .lines()
        .filter_map(|l| l.split(",http=").nth(1).map(str::to_owned))
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async move {
        let c = reqwest::Client::new();
        let mut before = Vec::new();
        for h in &https {
            before.push(info(&c, h).await);
        }
        let start = Instant::now();
        let end = start + Duration::from_secs_f64(seconds);
        let mut tasks = Vec::new();
        for (w, http) in https.iter().enumerate() {
            for k in 0..concurrency {
                let (c, url) = (c.clone(), format!("{http}/v1/completions"));
                tasks.push(tokio::spawn(async move {
                    let mut done = 0u64;
                    let mut n = 0u64;
                    while Instant::now() < end {
                        let shared = (0..256).map(|i| format!("w{}", (i + w) % 1000));
                        let own = (0..256).map(|i| format!("w{}", (i * 7 + k * 31 + n as usize * 13) % 1000));
                        let prompt: Vec<String> = shared.chain(own).collect();
                        let body = serde_json::json!({"prompt": prompt.join(" "), "max_tokens": 64, "stream": true});
                        n += 1;
                        let r = c
                            .post(&url)
                            .header("content-type", "application/json")
                            .body(body.to_string())
                            .send()
                            .await;
                        if let Ok(r) = r {
                            if r.text().await.is_ok() {
                                done += 1;
                            }
                        }
                    }
                    done
                }));
            }
        }
        let mut done = 0;
        for t in tasks {
            done += t.await.unwrap_or(0);
        }
        let wall = start.elapsed().as_secs_f64();
        println!("requests done: {done} in {wall:.1} s wall");
        for (h, b) in https.iter().zip(&before) {
            let a = info(&c, h).await;
            let steps = a["steps"].as_f64().unwrap_or(0.0) - b["steps"].as_f64().unwrap_or(0.0);
            let sim = a["sim_seconds"].as_f64().unwrap_or(0.0) - b["sim_seconds"].as_f64().unwrap_or(0.0);
            println!(
                "worker {}: {:.0} steps/s wall, {:.1} simulated s, lag max {:.3} simulated s",
                a["worker_id"],
                steps / wall,
                sim,
                a["lag_max_seconds"].as_f64().unwrap_or(0.0)
            );
        }
    });
}

//! The self-tuning cost's learner: it finds a known linear model from noisy observations, stays
//! finite and within its bounds whatever it is fed, waits for evidence, forgets workers that
//! left, and routes better than fixed weights when workers differ.

use kvbm_events::router::tune::{
    EXTERNALITY_DEFAULT, PREFILL_LOAD_SCALE_MAX, WARMUP_OBSERVATIONS, WORKER_SPEEDUP_MAX,
};
use kvbm_events::router::{
    select_mode, Candidate, Coefficients, Overlap, RoundRobin, RouteFeatures, RouterMode,
    SelectorConfig, Tuner, WorkerLoad,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The truth the observations come from (seconds, per token or block).
const TRUTH: Coefficients = Coefficients {
    c0: 0.05,
    c_compute: 2e-4,
    c_host: 5e-5,
    c_disk: 1e-4,
    c_dec: 1e-4,
    d0: 0.01,
    d1: 2e-5,
};

fn random_features(rng: &mut StdRng) -> RouteFeatures {
    RouteFeatures {
        pending_compute_tokens: rng.gen_range(0..8000),
        compute_tokens: rng.gen_range(0..4000),
        host_tokens: rng.gen_range(0..4000),
        disk_tokens: rng.gen_range(0..2000),
        decode_blocks: rng.gen_range(0..3000),
        requests: rng.gen_range(0..32),
        request_blocks: rng.gen_range(1..500),
    }
}

fn close(got: f64, want: f64, rel: f64) -> bool {
    (got - want).abs() <= rel * want.abs()
}

fn check_sane(c: &Coefficients) {
    for v in [c.c0, c.c_compute, c.c_host, c.c_disk, c.c_dec, c.d0, c.d1] {
        assert!(v.is_finite() && v >= 0.0, "{c:?}");
    }
    assert!(c.c_host <= c.c_compute && c.c_disk <= c.c_compute, "{c:?}");
    assert!(c.c_compute > 0.0, "{c:?}");
}

#[test]
fn the_learner_finds_a_known_model_and_its_dynamo_weights() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut tuner = Tuner::new(16);
    let w = (1, 0);
    for _ in 0..4000 {
        let f = random_features(&mut rng);
        // 5% multiplicative noise.
        let noise = 1.0 + rng.gen_range(-0.05..0.05);
        assert!(tuner.observe_ttft(w, &f, TRUTH.ttft(&f) * noise));
        let tokens = rng.gen_range(2..400);
        let tpot = (TRUTH.d0 + TRUTH.d1 * f.decode_blocks as f64) * noise;
        assert!(tuner.observe_tpot(w, f.decode_blocks, tokens, tpot));
    }
    let c = tuner.coefficients(w).unwrap();
    check_sane(&c);
    assert!(close(c.c_compute, TRUTH.c_compute, 0.05), "{c:?}");
    assert!(close(c.c_host, TRUTH.c_host, 0.15), "{c:?}");
    assert!(close(c.c_disk, TRUTH.c_disk, 0.15), "{c:?}");
    assert!(close(c.c_dec, TRUTH.c_dec, 0.10), "{c:?}");
    assert!((c.c0 - TRUTH.c0).abs() < 0.1, "{c:?}");
    assert!(close(c.d1, TRUTH.d1, 0.15), "{c:?}");
    assert!((c.d0 - TRUTH.d0).abs() < 0.01, "{c:?}");
    // Dynamo's weights: 2e-4 * 16 / 1e-4 = 32; 1 - 0.25 = 0.75; 1 - 0.5 = 0.5.
    let d = tuner.dynamo_weights().unwrap();
    assert!(close(d.prefill_load_scale, 32.0, 0.12), "{d:?}");
    assert!((d.host_cache_hit_weight - 0.75).abs() < 0.05, "{d:?}");
    assert!((d.disk_cache_hit_weight - 0.5).abs() < 0.08, "{d:?}");
    // Its predictions are within the noise.
    assert!(tuner.mean_abs_error() < 0.1, "{}", tuner.mean_abs_error());
    assert_eq!(tuner.counts().ttft, 4000);
    assert_eq!(tuner.counts().tpot, 4000);
}

#[test]
fn adversarial_observations_never_make_it_nan_or_break_its_bounds() {
    let mut rng = StdRng::seed_from_u64(3);
    let mut tuner = Tuner::new(16);
    let w = (7, 0);
    let zero = RouteFeatures::default();
    let huge = RouteFeatures {
        pending_compute_tokens: usize::MAX,
        compute_tokens: usize::MAX,
        host_tokens: usize::MAX,
        disk_tokens: usize::MAX,
        decode_blocks: usize::MAX,
        requests: usize::MAX,
        request_blocks: usize::MAX,
    };
    let mut refused = 0;
    for i in 0..3000u64 {
        let f = match i % 5 {
            0 => zero,
            1 => huge,
            _ => random_features(&mut rng),
        };
        let y = match i % 7 {
            0 => f64::NAN,
            1 => f64::INFINITY,
            2 => -1.0,
            3 => 0.0,
            4 => 1e12,
            5 => 1e-300,
            _ => rng.gen_range(0.0..100.0),
        };
        if !tuner.observe_ttft(w, &f, y) {
            refused += 1;
        }
        let tokens = [0, 1, 2, usize::MAX][(i % 4) as usize];
        if !tuner.observe_tpot(w, f.decode_blocks, tokens, y) {
            refused += 1;
        }
        for c in [tuner.coefficients(w), tuner.fleet_coefficients()]
            .into_iter()
            .flatten()
        {
            check_sane(&c);
        }
        if let Some(d) = tuner.dynamo_weights() {
            assert!((0.0..=PREFILL_LOAD_SCALE_MAX).contains(&d.prefill_load_scale));
            assert!((0.0..=1.0).contains(&d.host_cache_hit_weight));
            assert!((0.0..=1.0).contains(&d.disk_cache_hit_weight));
        }
        for f in [zero, huge] {
            let candidate = Candidate {
                worker: w,
                overlap: Overlap {
                    gpu: usize::MAX,
                    host: 3,
                    disk: 1,
                    shared: 0,
                },
                load: WorkerLoad {
                    prefill_tokens: f.pending_compute_tokens,
                    decode_blocks: f.decode_blocks,
                    requests: f.requests,
                },
                excess_work: 0.0,
            };
            if let Some(cost) = tuner.cost(&candidate, 100_000) {
                assert!(!cost.is_nan(), "{cost}");
            }
        }
        assert!(tuner.mean_abs_error().is_finite());
    }
    assert!(refused > 0);
    assert_eq!(tuner.counts().refused, refused, "every refusal is counted");
}

#[test]
fn until_warm_it_has_no_cost_and_a_worker_that_left_is_forgotten() {
    let mut rng = StdRng::seed_from_u64(5);
    let mut tuner = Tuner::new(16);
    let candidate = |id| Candidate {
        worker: (id, 0),
        overlap: Overlap::default(),
        load: WorkerLoad::default(),
        excess_work: 0.0,
    };
    for i in 0..WARMUP_OBSERVATIONS {
        assert!(!tuner.ready());
        assert_eq!(tuner.cost(&candidate(1), 1000), None);
        let f = random_features(&mut rng);
        tuner.observe_ttft((1 + i % 2, 0), &f, TRUTH.ttft(&f));
    }
    assert!(tuner.ready());
    assert!(tuner.cost(&candidate(1), 1000).is_some());
    // Once warm, an observation far above its prediction is clipped (and counted), not taken
    // whole: the coefficients move by less than a tenth of what it claims.
    let f = RouteFeatures {
        compute_tokens: 4000,
        ..RouteFeatures::default()
    };
    let before = tuner.coefficients((1, 0)).unwrap();
    let predicted = before.ttft(&f);
    assert!(tuner.observe_ttft((1, 0), &f, 1000.0 * predicted));
    assert_eq!(tuner.counts().clipped, 1);
    let after = tuner.coefficients((1, 0)).unwrap();
    assert!(after.ttft(&f) < 10.0 * predicted, "{before:?} -> {after:?}");
    // A worker never observed takes the fleet's coefficients.
    assert_eq!(tuner.coefficients((9, 0)), tuner.fleet_coefficients());
    assert!(tuner.cost(&candidate(9), 1000).is_some());
    assert_eq!(tuner.workers(), 2);
    tuner.forget((2, 0));
    assert_eq!(tuner.workers(), 1);
    assert!(tuner.view().iter().all(|w| w.worker != (2, 0)));
    assert_eq!(tuner.coefficients((2, 0)), tuner.fleet_coefficients());
}

/// Two workers, one three times slower at prefill; one 1000-token request per step. Fixed
/// weights see two idle workers as equal and split between them; the tuned cost learns the
/// difference (from the same observations) and sends more to the fast one, with a lower mean
/// time to first token.
#[test]
fn tuned_routing_beats_kv_when_one_worker_is_three_times_slower() {
    // Tokens each worker computes per step (0.1 s).
    let rates = [3000.0, 1000.0];
    let run = |mode: RouterMode| {
        let mut rng = StdRng::seed_from_u64(21);
        let mut tuner = Tuner::new(16);
        let config = SelectorConfig::for_mode(mode);
        let mut rr = RoundRobin::default();
        let mut pending = [0.0f64; 2];
        let (mut to_fast, mut ttft_sum, mut counted) = (0usize, 0.0, 0usize);
        for step in 0..600 {
            for (p, r) in pending.iter_mut().zip(rates) {
                *p = (*p - r).max(0.0);
            }
            let candidates: Vec<Candidate> = (0..2)
                .map(|i| Candidate {
                    worker: (i as u64 + 1, 0),
                    overlap: Overlap::default(),
                    load: WorkerLoad {
                        prefill_tokens: pending[i] as usize,
                        decode_blocks: 0,
                        requests: usize::from(pending[i] > 0.0),
                    },
                    excess_work: 0.0,
                })
                .collect();
            let cost = |c: &Candidate| tuner.cost(c, 1000).unwrap_or(f64::MAX);
            let learned: Option<&dyn Fn(&Candidate) -> f64> =
                if tuner.ready() { Some(&cost) } else { None };
            let s =
                select_mode(&config, &candidates, 1000, 16, &mut rng, &mut rr, learned).unwrap();
            let i = (s.chosen.0 - 1) as usize;
            let f = RouteFeatures::of(&candidates[i], 1000, 16);
            let ttft = 0.1 * (pending[i] + 1000.0) / rates[i];
            pending[i] += 1000.0;
            tuner.observe_ttft(s.chosen, &f, ttft);
            if step >= 200 {
                to_fast += usize::from(i == 0);
                ttft_sum += ttft;
                counted += 1;
            }
        }
        (to_fast as f64 / counted as f64, ttft_sum / counted as f64)
    };
    let (kv_share, kv_ttft) = run(RouterMode::Kv);
    let (tuned_share, tuned_ttft) = run(RouterMode::Tuned);
    assert!(
        tuned_share > kv_share + 0.15,
        "fast worker's share: tuned {tuned_share}, kv {kv_share}"
    );
    assert!(
        tuned_ttft < 0.8 * kv_ttft,
        "mean TTFT: tuned {tuned_ttft}, kv {kv_ttft}"
    );
}

/// The externality term: the same evidence, two weights on a request's own service time. A
/// worker with a queue of 3,000 tokens that holds the whole 2,000-token prompt, against an idle
/// worker that holds none of it: the request's own predicted TTFT is lower on the idle worker
/// (2,000 tokens to compute against 3,000 queued), so the greedy cost (weight 0) picks it; with
/// weight 1 the 2,000 computed tokens also count for the requests that will queue behind them,
/// and the worker that holds the prompt wins. The cost differs by exactly weight × service.
#[test]
fn the_externality_charges_a_request_its_own_service_time() {
    let mut rng = StdRng::seed_from_u64(8);
    let mut greedy = Tuner::new(16).with_externality(0.0);
    let mut social = Tuner::new(16).with_externality(1.0);
    assert_eq!(
        Tuner::new(16).with_externality(f64::NAN).externality(),
        EXTERNALITY_DEFAULT
    );
    assert_eq!(Tuner::new(16).with_externality(1e9).externality(), 100.0);
    for _ in 0..2000 {
        let f = random_features(&mut rng);
        let (w, y) = ((1 + rng.gen_range(0..2), 0), TRUTH.ttft(&f));
        assert!(greedy.observe_ttft(w, &f, y));
        assert!(social.observe_ttft(w, &f, y));
    }
    let holder = Candidate {
        worker: (1, 0),
        overlap: Overlap {
            gpu: 125,
            host: 0,
            disk: 0,
            shared: 0,
        },
        load: WorkerLoad {
            prefill_tokens: 3000,
            decode_blocks: 0,
            requests: 1,
        },
        excess_work: 0.0,
    };
    let idle = Candidate {
        worker: (2, 0),
        overlap: Overlap::default(),
        load: WorkerLoad::default(),
        excess_work: 0.0,
    };
    let pick = |t: &Tuner| {
        if t.cost(&holder, 2000).unwrap() < t.cost(&idle, 2000).unwrap() {
            holder.worker
        } else {
            idle.worker
        }
    };
    assert_eq!(pick(&greedy), idle.worker);
    assert_eq!(pick(&social), holder.worker);
    let c = social.coefficients(idle.worker).unwrap();
    let service = c.service(&RouteFeatures::of(&idle, 2000, 16));
    assert!(close(service, TRUTH.c_compute * 2000.0, 0.05), "{service}");
    let diff = social.cost(&idle, 2000).unwrap() - greedy.cost(&idle, 2000).unwrap();
    assert!(close(diff, service, 1e-9), "{diff} vs {service}");
}

/// Bounded loads: with bound 0.25, four workers holding 10, 2, 2 and 3 requests in flight (18
/// with the new one, an even share of 4.5) may hold at most ceil(1.25 × 4.5) - 1 = 5 to be
/// chosen; no bound, no cap; one candidate is never capped.
#[test]
fn the_load_cap_is_a_bounded_multiple_of_an_even_share() {
    let with = |requests: usize| Candidate {
        worker: (requests as u64, 0),
        overlap: Overlap::default(),
        load: WorkerLoad {
            prefill_tokens: 0,
            decode_blocks: 0,
            requests,
        },
        excess_work: 0.0,
    };
    let fleet = [with(10), with(2), with(2), with(3)];
    let bounded = Tuner::new(16).with_load_bound(0.25);
    assert_eq!(bounded.load_bound(), 0.25);
    assert_eq!(bounded.load_cap(&fleet), Some(6));
    assert_eq!(bounded.load_cap(&fleet[..1]), None);
    assert_eq!(Tuner::new(16).with_load_bound(0.0).load_cap(&fleet), None);
    assert_eq!(Tuner::new(16).with_load_bound(-1.0).load_cap(&fleet), None);
    // An idle fleet: every worker may take the first request.
    let idle = [with(0), with(0)];
    assert_eq!(bounded.load_cap(&idle), Some(1));
}

/// A worker's own fit may make it look at most `WORKER_SPEEDUP_MAX` times cheaper than the
/// fleet: nine workers at the truth and one whose observations say it computes ten times faster
/// (as a run of unrecorded cache hits would) — its published per-token costs stop at the
/// fleet's divided by the bound, so it cannot draw the fleet's requests on that evidence. A
/// worker 1.5 times faster is within the bound and learned as it is.
#[test]
fn a_worker_cannot_look_more_than_the_bound_cheaper_than_the_fleet() {
    let mut rng = StdRng::seed_from_u64(5);
    let mut tuner = Tuner::new(16);
    let (lucky, quick) = ((100, 0), (101, 0));
    let scaled = |k: f64| Coefficients {
        c0: TRUTH.c0 / k,
        c_compute: TRUTH.c_compute / k,
        c_host: TRUTH.c_host / k,
        c_disk: TRUTH.c_disk / k,
        c_dec: TRUTH.c_dec / k,
        ..TRUTH
    };
    for i in 0..6000u64 {
        let f = random_features(&mut rng);
        let (w, truth) = match i % 11 {
            0 => (lucky, scaled(10.0)),
            1 => (quick, scaled(1.5)),
            n => ((n, 0), TRUTH),
        };
        assert!(tuner.observe_ttft(w, &f, truth.ttft(&f)));
    }
    let fleet = tuner.fleet_coefficients().unwrap();
    let lucky_c = tuner.coefficients(lucky).unwrap();
    check_sane(&lucky_c);
    for (got, fleet) in [
        (lucky_c.c_compute, fleet.c_compute),
        (lucky_c.c_dec, fleet.c_dec),
    ] {
        // The floor follows the fleet's fit as it moves; the published values trail it by the
        // smoothing.
        assert!(
            got >= 0.8 * fleet / WORKER_SPEEDUP_MAX,
            "lucky {lucky_c:?} fleet {fleet:?}"
        );
        // Without the floor it would be near a tenth of the truth.
        assert!(
            got > 3.0 * fleet / 10.0,
            "lucky {lucky_c:?} fleet {fleet:?}"
        );
    }
    let quick_c = tuner.coefficients(quick).unwrap();
    assert!(
        close(quick_c.c_compute, TRUTH.c_compute / 1.5, 0.1),
        "quick {quick_c:?} fleet {fleet:?}"
    );
}

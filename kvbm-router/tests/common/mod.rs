//! What the front-end tests share: a scripted vLLM worker (an axum server on 127.0.0.1).

use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::post;
use serde_json::{json, Value};

/// A scripted worker: `/v1/completions` answers `"stream": true` with `stream(request)` as
/// server-sent events, anything else with a small whole completion. Returns its base URL.
pub async fn scripted_worker(stream: fn(&Value) -> Body) -> String {
    let completions = move |body: Bytes| async move {
        let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if req["stream"] == json!(true) {
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(stream(&req))
                .unwrap()
        } else {
            Response::builder()
                .header("content-type", "application/json")
                .body(Body::from(
                    json!({"object": "text_completion", "choices": [{"text": "ok"}]}).to_string(),
                ))
                .unwrap()
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new().route("/v1/completions", post(completions));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

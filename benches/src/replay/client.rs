//! One streamed `/v1/completions` request to the router, timed chunk by chunk.
//!
//! The answer is vLLM's OpenAI stream (`entrypoints/openai/completion/serving.py`,
//! `completion_stream_generator`): `data: {json}` events separated by blank lines, a last event
//! carrying `usage` when `stream_options.include_usage` is set, then `data: [DONE]`. The mocker
//! coalesces a request's tokens into at most one chunk per stream interval, so a chunk may carry
//! several tokens (one word each): the inter-token latency is therefore taken over the whole
//! answer, (last token's arrival - first token's) / (tokens - 1), never from chunk gaps.

use std::time::Instant;

use serde_json::Value as Json;

/// Splits a byte stream into the data of its server-sent events.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Vec<String>,
}

impl SseParser {
    /// Feeds bytes; returns the data of every event they completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        let mut start = 0;
        while let Some(nl) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let end = start + nl;
            let line = &self.buf[start..end];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() {
                if !self.data.is_empty() {
                    events.push(self.data.join("\n"));
                    self.data.clear();
                }
            } else if let Some(rest) = line.strip_prefix(b"data:") {
                let rest = rest.strip_prefix(b" ").unwrap_or(rest);
                self.data.push(String::from_utf8_lossy(rest).into_owned());
            }
            // Comments (":") and other fields (event:, id:, retry:) carry nothing we need.
            start = end + 1;
        }
        self.buf.drain(..start);
        events
    }
}

/// What one answer came to (times in wall seconds from the request's send).
#[derive(Debug, Default, Clone)]
pub struct Answer {
    pub first_token_s: Option<f64>,
    pub last_token_s: Option<f64>,
    pub done_s: f64,
    /// Tokens counted in the streamed text (one word per token).
    pub streamed_tokens: usize,
    pub chunks: usize,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// The answer's text, kept when asked (sessions send it back in the next turn).
    pub text: String,
    pub done: bool,
    pub error: Option<String>,
}

/// Folds the events of a stream into an [`Answer`].
#[derive(Debug)]
pub struct AnswerBuilder {
    pub answer: Answer,
    keep_text: bool,
}

impl AnswerBuilder {
    pub fn new(keep_text: bool) -> Self {
        Self {
            answer: Answer::default(),
            keep_text,
        }
    }

    /// One event's data, received `at_s` seconds after the send.
    pub fn event(&mut self, data: &str, at_s: f64) {
        let a = &mut self.answer;
        if a.error.is_some() {
            return;
        }
        if data.trim() == "[DONE]" {
            a.done = true;
            return;
        }
        let json: Json = match serde_json::from_str(data) {
            Ok(j) => j,
            Err(e) => {
                a.error = Some(format!("a stream event is not JSON ({e})"));
                return;
            }
        };
        if let Some(err) = json.get("error") {
            a.error = Some(format!("error event: {err}"));
            return;
        }
        if let Some(text) = json
            .pointer("/choices/0/text")
            .and_then(Json::as_str)
            .filter(|t| !t.is_empty())
        {
            let words = text.split_whitespace().count();
            if words > 0 {
                a.chunks += 1;
                a.streamed_tokens += words;
                a.first_token_s.get_or_insert(at_s);
                a.last_token_s = Some(at_s);
            }
            if self.keep_text {
                a.text.push_str(text);
            }
        }
        if let Some(usage) = json.get("usage").filter(|u| !u.is_null()) {
            a.prompt_tokens = usage.get("prompt_tokens").and_then(Json::as_u64);
            a.completion_tokens = usage.get("completion_tokens").and_then(Json::as_u64);
            a.cached_tokens = usage
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Json::as_u64);
        }
    }

    /// Ends the stream at `at_s`: checks it is whole and as long as asked.
    pub fn finish(mut self, at_s: f64, max_tokens: usize) -> Answer {
        let a = &mut self.answer;
        a.done_s = at_s;
        if a.error.is_none() {
            a.error = if !a.done {
                Some("the stream ended without [DONE]".into())
            } else if a.completion_tokens.is_none() || a.prompt_tokens.is_none() {
                Some("no usage in the stream".into())
            } else if a.completion_tokens != Some(a.streamed_tokens as u64) {
                Some(format!(
                    "streamed {} tokens but usage says {:?}",
                    a.streamed_tokens, a.completion_tokens
                ))
            } else if a.completion_tokens != Some(max_tokens as u64) {
                Some(format!(
                    "{:?} tokens with ignore_eos and max_tokens {max_tokens}",
                    a.completion_tokens
                ))
            } else {
                None
            };
        }
        self.answer
    }
}

impl Answer {
    /// Inter-token latency in wall seconds, over the whole answer.
    pub fn itl_s(&self) -> Option<f64> {
        let n = self.completion_tokens?;
        if n < 2 {
            return None;
        }
        Some((self.last_token_s? - self.first_token_s?) / (n - 1) as f64)
    }
}

/// An error and its sources, `: `-separated (reqwest's own text omits the cause).
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Sends one completion and reads its stream to the end.
pub async fn complete(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    prompt: String,
    max_tokens: usize,
    keep_text: bool,
) -> Answer {
    let body = serde_json::json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": true,
        "ignore_eos": true,
        "stream_options": {"include_usage": true},
    });
    let sent = Instant::now();
    let mut builder = AnswerBuilder::new(keep_text);
    let result = async {
        let mut response = client
            .post(url)
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&body).expect("a JSON value serializes"))
            .send()
            .await
            .map_err(|e| format!("sending: {}", chain(&e)))?;
        let status = response.status();
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            return Err(format!(
                "HTTP {status}: {}",
                text.chars().take(300).collect::<String>()
            ));
        }
        let mut parser = SseParser::default();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| format!("reading the stream: {}", chain(&e)))?
        {
            let at = sent.elapsed().as_secs_f64();
            for data in parser.push(&chunk) {
                builder.event(&data, at);
            }
        }
        Ok(())
    }
    .await;
    if let Err(e) = result {
        builder.answer.error = Some(e);
    }
    builder.finish(sent.elapsed().as_secs_f64(), max_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(text: &str) -> String {
        format!(
            "data: {}\n\n",
            serde_json::json!({"id": "cmpl-1", "object": "text_completion",
                "choices": [{"index": 0, "text": text, "finish_reason": null}]})
        )
    }

    const USAGE: &str = "data: {\"id\":\"cmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":6,\"total_tokens\":46,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n";

    #[test]
    fn sse_events_split_across_reads_and_crlf_come_out_whole() {
        let stream = format!(
            "{}: keep-alive\r\n\r\n{}{USAGE}data: [DONE]\n\n",
            chunk("w1"),
            chunk(" w2 w3").replace("\n\n", "\r\n\r\n")
        );
        // Byte by byte, and in one piece: the same events.
        let mut p = SseParser::default();
        let mut by_byte = Vec::new();
        for b in stream.as_bytes() {
            by_byte.extend(p.push(std::slice::from_ref(b)));
        }
        let whole = SseParser::default().push(stream.as_bytes());
        assert_eq!(by_byte, whole);
        assert_eq!(whole.len(), 4);
        assert_eq!(whole[3], "[DONE]");
        assert!(whole[1].contains("w2 w3"));
        // Multi-line data joins with a newline; an unfinished event stays buffered.
        let mut p = SseParser::default();
        assert_eq!(
            p.push(b"data: a\ndata: b\n\ndata: c"),
            vec!["a\nb".to_owned()]
        );
        assert_eq!(p.push(b"\n\n"), vec!["c".to_owned()]);
    }

    #[test]
    fn coalesced_chunks_count_every_token_and_itl_spans_the_answer() {
        let mut b = AnswerBuilder::new(true);
        // 6 tokens in 3 chunks: 1 at 1.0 s, 3 at 1.5 s, 2 at 2.0 s.
        for (text, at) in [("w1", 1.0), (" w2 w3 w4", 1.5), (" w5 w6", 2.0)] {
            for data in SseParser::default().push(chunk(text).as_bytes()) {
                b.event(&data, at);
            }
        }
        for data in SseParser::default().push(format!("{USAGE}data: [DONE]\n\n").as_bytes()) {
            b.event(&data, 2.1);
        }
        let a = b.finish(2.2, 6);
        assert_eq!(a.error, None);
        assert_eq!(a.streamed_tokens, 6);
        assert_eq!(a.chunks, 3);
        assert_eq!(a.first_token_s, Some(1.0));
        assert_eq!(a.cached_tokens, Some(32));
        // (2.0 - 1.0) / 5, not the mean chunk gap (0.5).
        assert!((a.itl_s().unwrap() - 0.2).abs() < 1e-12);
        assert_eq!(a.text, "w1 w2 w3 w4 w5 w6");
    }

    #[test]
    fn incomplete_or_short_streams_are_errors() {
        let run = |stream: &str, max_tokens: usize| {
            let mut b = AnswerBuilder::new(false);
            for data in SseParser::default().push(stream.as_bytes()) {
                b.event(&data, 1.0);
            }
            b.finish(1.0, max_tokens).error.unwrap_or_default()
        };
        let six = format!("{}{}", chunk("w1 w2 w3"), chunk("w4 w5 w6"));
        assert_eq!(run(&format!("{six}{USAGE}data: [DONE]\n\n"), 6), "");
        assert!(run(&format!("{six}{USAGE}"), 6).contains("without [DONE]"));
        assert!(run(&format!("{six}data: [DONE]\n\n"), 6).contains("no usage"));
        assert!(run(&format!("{six}{USAGE}data: [DONE]\n\n"), 7).contains("max_tokens 7"));
        assert!(run(&format!("{}{USAGE}data: [DONE]\n\n", chunk("w1")), 6).contains("streamed 1"));
        assert!(run("data: {\"error\": {\"message\": \"boom\"}}\n\n", 6).contains("boom"));
        assert!(run("data: {nope\n\n", 6).contains("not JSON"));
    }
}

#[cfg(test)]
mod http_tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A one-connection HTTP server on 127.0.0.1 that checks the request body and streams `parts`
    /// (chunked transfer encoding, one HTTP chunk per part).
    async fn serve(parts: Vec<String>) -> (String, tokio::task::JoinHandle<Json>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/completions", listener.local_addr().unwrap());
        let handle = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            let body = loop {
                let mut b = [0u8; 4096];
                let n = s.read(&mut b).await.unwrap();
                buf.extend_from_slice(&b[..n]);
                let text = String::from_utf8_lossy(&buf).into_owned();
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let len: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap())
                        })
                        .unwrap();
                    if body.len() >= len {
                        break serde_json::from_str::<Json>(body).unwrap();
                    }
                }
            };
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                .await
                .unwrap();
            for p in parts {
                s.write_all(format!("{:x}\r\n{p}\r\n", p.len()).as_bytes())
                    .await
                    .unwrap();
                s.flush().await.unwrap();
            }
            s.write_all(b"0\r\n\r\n").await.unwrap();
            body
        });
        (url, handle)
    }

    #[tokio::test]
    async fn a_streamed_completion_is_read_whole_with_its_usage() {
        let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4,\"total_tokens\":7,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n";
        // An event split across two HTTP chunks, and two events in one.
        let parts = vec![
            "data: {\"choices\":[{\"index\":0,\"te".to_owned(),
            "xt\":\"w1 w2\"}]}\n\ndata: {\"choices\":[{\"index\":0,\"text\":\" w3 w4\"}]}\n\n"
                .to_owned(),
            format!("{usage}data: [DONE]\n\n"),
        ];
        let (url, server) = serve(parts).await;
        let client = reqwest::Client::new();
        let a = complete(&client, &url, "m", "w1 w2 w3".into(), 4, true).await;
        assert_eq!(a.error, None);
        assert_eq!(
            (a.streamed_tokens, a.completion_tokens, a.prompt_tokens),
            (4, Some(4), Some(3))
        );
        assert_eq!(a.text, "w1 w2 w3 w4");
        assert!(a.first_token_s.unwrap() <= a.last_token_s.unwrap());
        let body = server.await.unwrap();
        assert_eq!(body["max_tokens"], 4);
        assert_eq!(body["stream"], true);
        assert_eq!(body["ignore_eos"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["prompt"], "w1 w2 w3");

        // A stream cut short (no [DONE]) is an error, not an answer.
        let (url, server) = serve(vec![
            "data: {\"choices\":[{\"index\":0,\"text\":\"w1\"}]}\n\n".into(),
        ])
        .await;
        let a = complete(&client, &url, "m", "w1".into(), 4, false).await;
        assert!(a.error.unwrap().contains("without [DONE]"));
        server.await.unwrap();
    }
}

"""vLLM's routes beside the OpenAI ones: POST /tokenize and /detokenize in vLLM's shapes, GET /version, /ping."""
from tests.stages.serve.http.conftest import serve


def test_tokenize_a_prompt_and_detokenize_it_back(server):
    tokenizer = server.state.tokenizer
    with server.client() as client:
        r = client.post("/tokenize", json={"model": "tiny", "prompt": "hello world", "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == tokenizer.encode("hello world") and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == 128 and body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
        plain = client.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
        assert plain["tokens"] == tokenizer.encode("hello world", add_special_tokens=False)
        assert plain["token_strs"] is None
        back = client.post("/detokenize", json={"tokens": plain["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(plain["tokens"])}


def test_tokenize_chat_messages_through_the_template(server):
    tokenizer = server.state.tokenizer
    messages = [{"role": "user", "content": "hi"}]
    with server.client() as client:
        body = client.post("/tokenize", json={"messages": messages}).json()
        bare = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare["count"] < body["count"]  # no "<assistant>" turn opened


def test_bad_tokenize_and_detokenize_requests_are_400_or_404(server):
    with server.client() as client:
        assert client.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
        assert client.post("/detokenize", json={"tokens": ["a"]}).status_code == 400
        assert client.post("/tokenize", json={}).status_code == 400
        assert client.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404


def test_version_and_ping(server):
    with server.client() as client:
        version = client.get("/version")
        assert version.status_code == 200 and version.json()["version"]
        for method in ("GET", "POST"):
            ping = client.request(method, "/ping")
            assert ping.status_code == 200 and ping.json() == {"status": "ok", "num_requests_running": 0,
                                                               "num_requests_waiting": 0}


def test_ping_needs_no_key_like_health_and_tokenize_does(model_dir):
    with serve(model_dir, api_key="secret") as running, running.client() as client:
        assert client.get("/ping").status_code == 200
        assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 401
        ok = client.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200

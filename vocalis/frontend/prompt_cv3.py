"""CosyVoice 3's LLM prompts: the official usage puts a system part ending in `<|endofprompt|>` before the text
(`CosyVoice3LM.inference` asserts the token is in prompt_text + text), which the official API leaves to the caller:

    zero-shot      prompt text  "You are a helpful assistant.<|endofprompt|>" + the voice's transcript
    cross-lingual  prompt text  "You are a helpful assistant.<|endofprompt|>"   (no prompt speech for the LLM)
    sft            the same as cross-lingual (a built-in speaker of spk2info)
    instruct       prompt text  "You are a helpful assistant. " + instruction + "<|endofprompt|>" (official instruct2)

A transcript or instruction already holding `<|endofprompt|>` is taken as it is. The system part goes in the prompt
text (not the text, where the official examples write it for cross-lingual): the rows fed are the same, the LLM's
prefix cache shares it between requests, and the length bounds count the spoken text only. Voices from audio and
voice conversion are as for CosyVoice 2 (`Frontend`), with the v3 speech tokenizer and a mel without an upper edge.
"""

from __future__ import annotations

from vocalis.config import CV3_SPEECH_TOKENIZER_ONNX, ENDOFPROMPT_TOKEN
from vocalis.frontend.prompt import Frontend
from vocalis.frontend.request import Mode, SynthesisRequest

CV3_SYSTEM_PROMPT = "You are a helpful assistant."


class CV3Frontend(Frontend):
    speech_tokenizer_file = CV3_SPEECH_TOKENIZER_ONNX
    prompt_mel_fmax = None  # CosyVoice 3's feature extractor has no upper mel edge

    def system_ids(self) -> list[int]:
        """Ids of the system part every CosyVoice 3 prompt starts with."""
        return self.tokenizer.encode(CV3_SYSTEM_PROMPT + ENDOFPROMPT_TOKEN)

    def llm_prompt(self, request: SynthesisRequest) -> tuple[list[int], list[int]]:
        """(prompt text ids, prompt speech ids) the LLM sees before the text (see the module table)."""
        voice = request.voice
        end = self.tokenizer.endofprompt_id
        if request.mode is Mode.ZERO_SHOT:
            text = list(voice.prompt_text_ids)
            return (text if end in text else self.system_ids() + text), list(voice.prompt_speech_ids)
        if request.mode is Mode.INSTRUCT:
            instruct = request.instruct.strip()
            if ENDOFPROMPT_TOKEN not in instruct:
                if not instruct.startswith(CV3_SYSTEM_PROMPT):
                    instruct = f"{CV3_SYSTEM_PROMPT} {instruct}"
                instruct += ENDOFPROMPT_TOKEN
            return self.tokenizer.encode(instruct), []
        if request.mode is Mode.VC:
            return [], []
        return self.system_ids(), []  # cross-lingual, sft
